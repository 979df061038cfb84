"""verl's `custom_reward_function.path` / `.name`: a user's reward function loaded from a file.

    custom_reward_function:
      path: my_rewards.py        # a Python file
      name: compute_score        # the function in it (default compute_score)

With `reward_model.reward_manager: naive` it is called per sample as
`fn(data_source, solution_str, ground_truth, extra_info)`; with `batch`, once per step with lists:
`fn(data_sources, solution_strs, ground_truths, extra_infos)` -> one result per sample. A result
is a float or a dict with "score" (other keys are reported as reward extras).

Tests: tests/test_config_keys.py, tests/test_guard_rewards.py, tests/test_rollout_pool.py
"""
import importlib.util
import inspect
import os


def load_custom_reward(path, name="compute_score"):
    """The function `name` of the Python file `path`; one clear error for a wrong path or name."""
    if not os.path.isfile(path):
        raise ValueError(f"custom_reward_function.path={path!r}: no such file; give the path of a Python "
                         f"file defining {name}(data_source, solution_str, ground_truth, extra_info)")
    spec = importlib.util.spec_from_file_location(f"trident_custom_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: say which one failed to import, and why
        raise ValueError(f"custom_reward_function.path={path!r} could not be imported: "
                         f"{type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(f"custom_reward_function.name={name!r} is not a function of {path}; "
                         f"functions there: {found}")
    if len(inspect.signature(fn).parameters) < 3:
        raise ValueError(f"custom_reward_function {name} in {path} takes fewer than 3 arguments; it is "
                         f"called as {name}(data_source, solution_str, ground_truth, extra_info)")
    return fn
