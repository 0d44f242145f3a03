"""SSD's speculator: the worker process, its channel, the proposers and the draft-tree plan."""
