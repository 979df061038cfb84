"""The phase this process is in ("startup", "gen", "update_actor", ...), for launchers that report
where a rank died (engine.launch_ray reads it from the rank's actor). A plain module global: a
string assignment is atomic, so another thread may read it at any time without a lock.

Tests: tests/test_launch_ray.py
"""
_current = "startup"


def set_phase(name: str) -> None:
    global _current
    _current = name


def current_phase() -> str:
    return _current
