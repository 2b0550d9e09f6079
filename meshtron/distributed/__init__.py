"""One module per parallelism, and ``parallelize.parallelize_model`` that applies them in order."""
