"""Step tracing from inside the training frameworks people already use.

``tracer.integrations.hf.TraceCallback`` (a ``transformers.TrainerCallback``) and
``tracer.integrations.lightning.TraceCallback`` (a Lightning ``Callback``) trace chosen optimizer
steps of a ``Trainer`` run into one file, step numbers from the trainer's own ``global_step``.
Each module imports its framework, so import the one you use; nothing is imported here.
"""
