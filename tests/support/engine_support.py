"""What the worker tests share around a running engine: a step hook that runs test code in
the engine thread, and a walk over the radix tree."""

from __future__ import annotations

import queue
import threading

WAIT_S = 30.0


class InEngine:
    """A step hook that runs test code in the engine thread (only that thread touches the engine)."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.wait_s = wait_s

    def __call__(self, engine) -> None:
        while not self.jobs.empty():
            fn, box, done = self.jobs.get()
            try:
                box.append(fn(engine))
            except Exception as e:  # noqa: BLE001 - handed back to the test thread
                box.append(e)
            done.set()

    def run(self, fn):
        box, done = [], threading.Event()
        self.jobs.put((fn, box, done))
        if not done.wait(self.wait_s):
            raise TimeoutError("the engine thread did not run the job")
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]


def tree_nodes(tree):
    """Every node of a radix tree but its root, depth first."""
    stack = list(tree.root.children.values())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())
