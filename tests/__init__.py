# Importing engine first defers what Megatron imports and never uses (engine/lazy_imports.py),
# also for test modules that import Megatron before engine.
import engine  # noqa: F401
