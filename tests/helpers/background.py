"""Compiles a module's tests need, run in the background two at a time (one compile keeps one core
busy for 10-50 s, and one at a time left the other idle), each once, queued in the order the
session runs the tests: each test waits only for its own."""
import concurrent.futures
import contextlib


class BackgroundCompiles:
    """The compiles queued, by key."""

    def __init__(self, pool):
        self.pool, self.futures = pool, {}

    def queue(self, key, compile, *args):
        """The future of key's compile, started (compile(*args)) if it is not yet queued."""
        if key not in self.futures:
            self.futures[key] = self.pool.submit(compile, *args)
        return self.futures[key]

    def result(self, key):
        return self.futures[key].result()


@contextlib.contextmanager
def background_compiles(session, test_name, compile_for, workers=2):
    """Yields a BackgroundCompiles that has queued, for each item of test_name the session runs, in
    order, compile_for(its parameters) -> (key, compile, *args); what has not started when the
    fixture ends is cancelled."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        compiles = BackgroundCompiles(pool)
        for item in session.items:
            if getattr(item, "originalname", None) == test_name:
                compiles.queue(*compile_for(item.callspec.params))
        yield compiles
        pool.shutdown(cancel_futures=True)
