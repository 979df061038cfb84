"""Build parquet prompt data for Trident.

    python tools/prepare_data.py --input gsm8k_train.jsonl --output data/gsm8k/train.parquet
    python tools/prepare_data.py --builtin arith --out-dir data/arith [--difficulty 0]
    python tools/prepare_data.py --reasoning-gym basic_arithmetic --out-dir data/rg_arith
    python tools/prepare_data.py --pairs --builtin arith --out-dir data/arith_pairs [--graded]
    python tools/prepare_data.py --pairs --input pairs.jsonl --output data/pairs.parquet

GSM8K-style JSONL has one {"question": ..., "answer": "... #### 42"} per line. Each row becomes a
chat prompt with the step-by-step instruction, reward_model.ground_truth = the number after
"####", data_source "openai/gsm8k". `--builtin` writes train/val parquet of a task from
engine/tasks.py and saves its tokenizer under OUT_DIR/tokenizer.

`--pairs` writes preference pairs (trainer.task reward_model / dpo) instead: from `--builtin
arith` (chosen = the correct answer, rejected = a wrong one) or from a JSONL of {"prompt",
"chosen", "rejected", ...} records (text or chat messages; other fields such as a margin are
kept). Empty and identical pairs are dropped and counted; over-long ones are the loader's
business (data.truncation), as it knows the tokenizer and the length limits.

Tests: tests/test_data.py, tests/test_preference_data.py, tests/test_offline_pipeline.py
"""
import argparse
import difflib
import json
import os
import shutil
import sys
import tempfile
import typing

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.tasks import BuiltinTask  # noqa: E402
from engine.errors import (ArgumentParser, DataError, UsageError, positive, require_file,  # noqa: E402
                           run_main)

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
GSM8K_SOURCE = "openai/gsm8k"


def gsm8k_final_answer(answer_text):
    """The number after the last '####' of a GSM8K answer, commas removed."""
    if "####" not in answer_text:
        raise ValueError(f"GSM8K answer has no '####': {answer_text[-80:]!r}")
    return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_rows(jsonl_path, split="train"):
    rows = []
    try:
        with open(jsonl_path, encoding="utf-8") as f:
            lines = list(f)
    except UnicodeDecodeError as e:
        line_no = open(jsonl_path, "rb").read()[:e.start].count(b"\n") + 1
        raise DataError(f"{jsonl_path}:{line_no}: not UTF-8 text (byte 0x{e.object[e.start]:02x}); save the "
                        "JSONL as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            question, answer = record["question"], record["answer"]
            truth = gsm8k_final_answer(answer)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(f"{jsonl_path}:{line_no}: not a GSM8K record with 'question' and "
                            f"'answer ... #### N' ({type(e).__name__}: {e}); fix or remove that line") from None
        rows.append({
            "data_source": GSM8K_SOURCE,
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": len(rows), "question": question, "answer": answer},
        })
    if not rows:
        raise DataError(f"{jsonl_path} holds no records (empty or blank lines only); pass a GSM8K-style JSONL")
    return rows


def write_prompt_parquet(rows, path):
    from engine.data import write_prompt_parquet as write  # torch: imported only to write
    write(rows, path)


def write_builtin(name, out_dir, n_train, n_val, seed, difficulty):
    from engine import tasks
    train, val, _ = tasks.make_builtin_task(name, seed=seed, n_train=n_train, n_val=n_val, difficulty=difficulty)
    write_prompt_parquet(train, os.path.join(out_dir, "train.parquet"))
    write_prompt_parquet(val, os.path.join(out_dir, "val.parquet"))
    tasks.save_tokenizer(os.path.join(out_dir, "tokenizer"))


def _reasoning_gym_kwargs(task, text):
    """The generator settings of --task-kwargs, checked by building a one-row dataset."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--task-kwargs {text!r} is not JSON ({e.msg} at column {e.colno}); write e.g. "
                         "'{\"min_terms\": 2}'") from None
    if not isinstance(kwargs, dict):
        raise UsageError(f"--task-kwargs {text!r} must be a JSON object of generator settings")
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise UsageError("--reasoning-gym needs the reasoning-gym package: pip install reasoning-gym") from None
    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        raise UsageError(f"--reasoning-gym {task!r} is not a reasoning-gym task"
                         + (f"; did you mean {', '.join(close)}?" if close else ""))
    try:
        reasoning_gym.create_dataset(task, size=1, seed=0, **kwargs)
    except (TypeError, ValueError, AssertionError) as e:  # unknown or impossible settings
        raise UsageError(f"--task-kwargs {text!r} for {task!r}: {e}") from None
    return kwargs


def _check_out_dir(out_dir):
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"--out-dir {out_dir!r} is a file; give a directory")


def _write_all(out_dir, write):
    """Run `write(tmp_dir)` into a temporary sibling of `out_dir`, then move what it wrote into
    `out_dir` (replacing files of the same names): a failure leaves nothing behind."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        write(tmp)
        if not os.path.exists(out_dir):
            os.rename(tmp, out_dir)
            return
        for name in os.listdir(tmp):
            target = os.path.join(out_dir, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(tmp, name), target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_pairs(args, parser):
    from engine.data.preference import arith_pairs, jsonl_pairs, write_preference_parquet
    if args.builtin:
        if args.builtin != "arith" or not args.out_dir:
            parser.error("--pairs --builtin supports arith, with --out-dir")
        _check_out_dir(args.out_dir)

        def write(folder):
            from engine import tasks
            for split, n in (("train", args.n_train), ("val", args.n_val)):
                write_preference_parquet(arith_pairs(n, args.seed, args.difficulty, split, graded=args.graded),
                                         os.path.join(folder, f"{split}.parquet"))
            tasks.save_tokenizer(os.path.join(folder, "tokenizer"))
        _write_all(args.out_dir, write)
        print(f"wrote {args.n_train} train / {args.n_val} val arith pairs to {args.out_dir}")
    elif args.input and args.output:
        require_file(args.input, "--input", "pass a JSONL file of {prompt, chosen, rejected} records")
        try:
            rows, dropped = jsonl_pairs(args.input)
            write_preference_parquet(rows, args.output)
        except UnicodeDecodeError as e:
            raise DataError(f"{args.input}: not UTF-8 text (byte {e.start}); save the JSONL as UTF-8") from None
        except ValueError as e:  # engine/data/preference.py: a malformed line or column, named
            raise DataError(str(e)) from None
        print(f"wrote {len(rows)} pairs to {args.output}; dropped {json.dumps(dropped)}")
    else:
        parser.error("--pairs needs --builtin arith --out-dir DIR, or --input X.jsonl --output Y.parquet")


def main(argv=None):
    return run_main(_main, argv)


def _main(argv=None):
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="GSM8K-style JSONL file")
    parser.add_argument("--output", help="parquet file to write (with --input)")
    parser.add_argument("--split", default="train", help="split name recorded in extra_info")
    parser.add_argument("--builtin", choices=typing.get_args(BuiltinTask), help="write a built-in task instead")
    parser.add_argument("--out-dir", help="directory for the built-in task's train/val parquet")
    parser.add_argument("--n-train", type=positive(int, "the number of training rows, e.g. 2048"), default=2048)
    parser.add_argument("--n-val", type=positive(int, "the number of validation rows, e.g. 128"), default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, choices=(0, 1, 2), default=0)
    parser.add_argument("--reasoning-gym", metavar="TASK",
                        help="write a reasoning-gym task (e.g. basic_arithmetic) to --out-dir")
    parser.add_argument("--task-kwargs", default="{}",
                        help="JSON of the reasoning-gym generator's settings")
    parser.add_argument("--pairs", action="store_true",
                        help="write preference pairs (reward model / DPO data)")
    parser.add_argument("--graded", action="store_true",
                        help="--pairs --builtin arith: graded pairs (answer > answer + more > wrong > junk > "
                             "nothing), for a reward model that PPO trains on alone")
    args = parser.parse_args(argv)
    if args.pairs:
        return write_pairs(args, parser)
    if args.reasoning_gym:
        if not args.out_dir:
            parser.error("--reasoning-gym needs --out-dir")
        _check_out_dir(args.out_dir)
        from engine.rewards.reasoning_gym import make_rows
        kwargs = _reasoning_gym_kwargs(args.reasoning_gym, args.task_kwargs)

        def write(folder):
            for split, n, seed in (("train", args.n_train, args.seed), ("val", args.n_val, args.seed + 1)):
                write_prompt_parquet(make_rows(args.reasoning_gym, n, seed, split, **kwargs),
                                     os.path.join(folder, f"{split}.parquet"))
        _write_all(args.out_dir, write)
        print(f"wrote {args.n_train} train / {args.n_val} val rows of reasoning-gym "
              f"{args.reasoning_gym!r} to {args.out_dir}")
        return
    if args.builtin:
        if not args.out_dir:
            parser.error("--builtin needs --out-dir")
        _check_out_dir(args.out_dir)
        _write_all(args.out_dir, lambda folder: write_builtin(args.builtin, folder, args.n_train, args.n_val,
                                                             args.seed, args.difficulty))
        print(f"wrote {args.n_train} train / {args.n_val} val rows of {args.builtin!r} to {args.out_dir}")
    elif args.input and args.output:
        require_file(args.input, "--input", "pass a GSM8K-style JSONL file")
        if os.path.isdir(args.output):
            raise UsageError(f"--output {args.output!r} is a directory; give a .parquet file name")
        rows = gsm8k_rows(args.input, args.split)
        write_prompt_parquet(rows, args.output)
        print(f"wrote {len(rows)} rows to {args.output}")
    else:
        parser.error("give --input X.jsonl --output Y.parquet, or --builtin NAME --out-dir DIR")


if __name__ == "__main__":
    sys.exit(main())
