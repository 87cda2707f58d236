"""The rank bodies of the multi-process tests, started with ``torch.multiprocessing.spawn``.

A spawned process unpickles its function by module name: these modules import as
``_workers.<name>`` there because a spawned child gets the parent's ``sys.path``, where
pytest put ``tests/`` (``pythonpath = ["tests"]``); the test files themselves do not import
in the child (pytest's importlib mode names them ``tests.<op>.test_...``, and the venv has
another top-level ``tests`` package)."""
