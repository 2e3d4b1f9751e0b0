"""Warm images (issue 28): images of ready, idle workers, one per kind, kept in a bounded
store on each node, so that a start is a restore instead of a cold load and compile.

- `relocator.warm.key`: the kind of a worker and its content-addressed key;
- `relocator.warm.store`: a node's store (atomic put, get/use, list, rm, LRU eviction);
- `relocator.warm.roots`: where a node's store lives (tmpfs where it fits, else disk);
- `relocator.warm.capture`: dump a ready worker with CRIU leave-running into the store;
- `relocator.warm.start`: restore a stored image into a fresh cell.
"""
