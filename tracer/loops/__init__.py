"""Whole training loops: chosen steps of a long run, and running a script under gradtrace."""
