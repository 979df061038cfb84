"""Build parquet prompt data for Trident.

    python tools/prepare_data.py --input gsm8k_train.jsonl --output data/gsm8k/train.parquet
    python tools/prepare_data.py --builtin arith --out-dir data/arith [--difficulty 0]
    python tools/prepare_data.py --reasoning-gym basic_arithmetic --out-dir data/rg_arith
    python tools/prepare_data.py --pairs --builtin arith --out-dir data/arith_pairs
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
"""
import argparse
import json
import os
import sys

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import tasks  # noqa: E402
from engine.data import write_prompt_parquet  # noqa: E402

GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
GSM8K_SOURCE = "openai/gsm8k"


def gsm8k_final_answer(answer_text):
    """The number after the last '####' of a GSM8K answer, commas removed."""
    if "####" not in answer_text:
        raise ValueError(f"GSM8K answer has no '####': {answer_text[-80:]!r}")
    return answer_text.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_rows(jsonl_path, split="train"):
    rows = []
    with open(jsonl_path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                question, answer = record["question"], record["answer"]
                truth = gsm8k_final_answer(answer)
            except (json.JSONDecodeError, KeyError, ValueError) as e:
                raise ValueError(f"{jsonl_path}:{line_no}: not a GSM8K record with 'question' and "
                                 f"'answer ... #### N' ({e})") from None
            rows.append({
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": len(rows), "question": question, "answer": answer},
            })
    return rows


def write_builtin(name, out_dir, n_train, n_val, seed, difficulty):
    train, val, _ = tasks.make_builtin_task(name, seed=seed, n_train=n_train, n_val=n_val, difficulty=difficulty)
    write_prompt_parquet(train, os.path.join(out_dir, "train.parquet"))
    write_prompt_parquet(val, os.path.join(out_dir, "val.parquet"))
    tasks.save_tokenizer(os.path.join(out_dir, "tokenizer"))


def write_pairs(args, parser):
    from engine.offline.data import arith_pairs, jsonl_pairs, write_preference_parquet
    if args.builtin:
        if args.builtin != "arith" or not args.out_dir:
            parser.error("--pairs --builtin supports arith, with --out-dir")
        for split, n in (("train", args.n_train), ("val", args.n_val)):
            write_preference_parquet(arith_pairs(n, args.seed, args.difficulty, split),
                                     os.path.join(args.out_dir, f"{split}.parquet"))
        tasks.save_tokenizer(os.path.join(args.out_dir, "tokenizer"))
        print(f"wrote {args.n_train} train / {args.n_val} val arith pairs to {args.out_dir}")
    elif args.input and args.output:
        rows, dropped = jsonl_pairs(args.input)
        write_preference_parquet(rows, args.output)
        print(f"wrote {len(rows)} pairs to {args.output}; dropped {json.dumps(dropped)}")
    else:
        parser.error("--pairs needs --builtin arith --out-dir DIR, or --input X.jsonl --output Y.parquet")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="GSM8K-style JSONL file")
    parser.add_argument("--output", help="parquet file to write (with --input)")
    parser.add_argument("--split", default="train", help="split name recorded in extra_info")
    parser.add_argument("--builtin", choices=tasks.BUILTIN_TASKS, help="write a built-in task instead")
    parser.add_argument("--out-dir", help="directory for the built-in task's train/val parquet")
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--n-val", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--reasoning-gym", metavar="TASK",
                        help="write a reasoning-gym task (e.g. basic_arithmetic) to --out-dir")
    parser.add_argument("--task-kwargs", default="{}",
                        help="JSON of the reasoning-gym generator's settings")
    parser.add_argument("--pairs", action="store_true",
                        help="write preference pairs (reward model / DPO data)")
    args = parser.parse_args(argv)
    if args.pairs:
        try:
            return write_pairs(args, parser)
        except ValueError as e:  # bad input: one line, not a traceback
            parser.exit(2, f"error: {e}\n")
    if args.reasoning_gym:
        if not args.out_dir:
            parser.error("--reasoning-gym needs --out-dir")
        from engine.rewards.reasoning_gym import make_rows
        kwargs = json.loads(args.task_kwargs)
        os.makedirs(args.out_dir, exist_ok=True)
        for split, n, seed in (("train", args.n_train, args.seed), ("val", args.n_val, args.seed + 1)):
            write_prompt_parquet(make_rows(args.reasoning_gym, n, seed, split, **kwargs),
                                 os.path.join(args.out_dir, f"{split}.parquet"))
        print(f"wrote {args.n_train} train / {args.n_val} val rows of reasoning-gym "
              f"{args.reasoning_gym!r} to {args.out_dir}")
        return
    if args.builtin:
        if not args.out_dir:
            parser.error("--builtin needs --out-dir")
        write_builtin(args.builtin, args.out_dir, args.n_train, args.n_val, args.seed, args.difficulty)
        print(f"wrote {args.n_train} train / {args.n_val} val rows of {args.builtin!r} to {args.out_dir}")
    elif args.input and args.output:
        rows = gsm8k_rows(args.input, args.split)
        write_prompt_parquet(rows, args.output)
        print(f"wrote {len(rows)} rows to {args.output}")
    else:
        parser.error("give --input X.jsonl --output Y.parquet, or --builtin NAME --out-dir DIR")


if __name__ == "__main__":
    main()
