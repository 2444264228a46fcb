"""One daemon thread that runs the jobs given to it one after another: the pack's work beside a prompt
(:mod:`.compile_import`'s imports and compile-file hot-load, :mod:`.pinned_host`'s page-locking of host copies).

A job's failure is its own: the thread catches everything a job raises, even ``SystemExit``, hands it to
``on_error`` where one is given, and goes on with the next job, so :meth:`Worker.wait` never waits on a thread that
a job ended."""
from __future__ import annotations

import queue
import threading

__all__ = ["Worker"]


class Worker:
    def __init__(self, name: str, on_error=None):
        self.name, self.on_error = name, on_error
        self.jobs: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _work(self) -> None:
        while True:
            fn, args = self.jobs.get()
            try:
                fn(*args)
            except BaseException as e:  # even SystemExit: the worker lives on, or wait() would wait for ever
                if self.on_error is not None:
                    try:
                        self.on_error(e)
                    except Exception:
                        pass
            finally:
                self.jobs.task_done()

    def start(self) -> bool:
        """Start the thread where none runs (the first call, or after the last one was gone); True where this call
        started it."""
        with self._lock:
            if self.thread is not None and self.thread.is_alive():
                return False
            self.thread = threading.Thread(target=self._work, name=self.name, daemon=True)
            self.thread.start()
            return True

    def put(self, fn, *args) -> None:
        """Give ``fn(*args)`` to the thread, after the jobs given before it."""
        self.jobs.put((fn, args))

    def wait(self) -> None:
        """Return once every job given so far is done: at once where no thread was started, or on the thread
        itself; not on a thread that is gone (interpreter shutdown)."""
        with self._lock:
            t = self.thread
        if t is None or t is threading.current_thread():
            return
        with self.jobs.all_tasks_done:  # queue.join(), but not on a thread that is gone
            while self.jobs.unfinished_tasks and t.is_alive():
                self.jobs.all_tasks_done.wait(0.5)
