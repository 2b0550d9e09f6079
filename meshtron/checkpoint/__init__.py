"""Distributed checkpoints (DCP): save, resume under any layout, export to Hugging Face."""
