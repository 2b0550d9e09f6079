"""One module per parallelism, and ``parallelize.parallelize`` that applies them in order."""
