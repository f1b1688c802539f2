"""Data plane: persistent batch, block tables, attention metadata (torch, CPU or CUDA)."""
