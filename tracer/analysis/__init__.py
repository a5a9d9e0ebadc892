"""Pure functions of a Trace (live or loaded): numerics, error explanations, memory views."""
