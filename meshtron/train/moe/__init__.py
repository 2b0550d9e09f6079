"""Mixture-of-experts routing in training: the router load-balancing loss (also under pipeline parallelism) and
the auxiliary-loss-free bias balancing."""
