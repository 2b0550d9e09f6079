"""``meshtron check``: does every parallel layout train the same model as one process, on this machine?

* ``layouts``: the layouts N ranks can host and the one-process runs they are compared with;
* ``worker``: one rank of one run (meshtron's own training loop), and the test-only deliberate defect;
* ``compare``: the differences and their bounds (CPU / gloo, CUDA / NCCL);
* ``report``: the environment, the table, the verdict;
* ``runner``: runs them one after another on fresh processes from a forkserver.

See docs/new-cluster.md.
"""
