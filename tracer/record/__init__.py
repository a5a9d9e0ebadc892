"""The recording layer: what runs inside the user's process while a block is traced."""
