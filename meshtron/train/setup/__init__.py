"""A run's set-up: preflight's checks and what they resolve (``RunSetup``), the model built for the run, and what every
rank imports before the launchers fork it."""
