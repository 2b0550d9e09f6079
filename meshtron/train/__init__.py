"""Process start-up, optimizer and schedule, and the training loop."""
