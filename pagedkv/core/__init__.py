"""Control plane: block pool, hashing, managers, scheduler. Pure Python + numpy, no torch."""
