"""Engine: drivers on top of the index layer (index-only trace driver; the model engine later)."""
