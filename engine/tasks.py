"""Built-in verifiable tasks for the tiny CPU demo: no downloads, a character-level tokenizer.

`arith`: prompts like "3+4=" whose answer ("7") the policy must emit, then stop (eos).
`copy`:  prompts like "47=" whose answer is the digits before "=" ("47").

`difficulty` sets how hard it is to learn from random init:

    arith 0: a+b, a, b in 0..4          (answer one token: 0..8)
    arith 1: a+b, a, b in 0..9          (answer one or two tokens)
    arith 2: a+b or a-b, a, b in 0..99  (answer up to three tokens, may be negative)
    copy  d: a number with d+1 digits

Rows follow the parquet prompt schema of engine/data.py; their `data_source` selects the
graded reward in engine/rewards/arith.py (dense enough for GRPO to rise from random init).
"""
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHARACTERS = list("0123456789+-*= #")
# The template only prepends bos: the prompt text itself is the whole "conversation".
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"

BUILTIN_TASKS = ("arith", "copy")


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast over digits, + - * = space and '#'."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one char, one token
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                        pad_token=PAD, unk_token=UNK, padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer(directory):
    """Write the built-in tokenizer so `AutoTokenizer.from_pretrained(directory)` loads it."""
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(directory)
    return tokenizer


def _arith_example(rng, difficulty):
    if difficulty == 0:
        a, b, op = rng.randint(0, 4), rng.randint(0, 4), "+"
    elif difficulty == 1:
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), "+"
    else:
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-")
    answer = a + b if op == "+" else a - b
    return f"{a}{op}{b}=", str(answer)


def _copy_example(rng, difficulty):
    digits = "".join(rng.choice("0123456789") for _ in range(difficulty + 1))
    return f"{digits}=", digits


_GENERATORS = {"arith": _arith_example, "copy": _copy_example}


def make_rows(name, n, seed, difficulty=0, split="train"):
    """`n` rows of task `name` in the parquet prompt schema, reproducible from `seed`."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown built-in task {name!r}; choose one of {list(BUILTIN_TASKS)}")
    if difficulty not in (0, 1, 2):
        raise ValueError(f"difficulty={difficulty!r} for task {name!r}; choose 0, 1 or 2")
    rng = random.Random(f"{name}-{difficulty}-{split}-{seed}")
    rows = []
    for index in range(n):
        prompt, answer = _GENERATORS[name](rng, difficulty)
        rows.append({
            "data_source": name,
            "prompt": [{"role": "user", "content": prompt}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "difficulty": difficulty},
        })
    return rows


def make_builtin_task(name="arith", seed=0, n_train=1024, n_val=128, difficulty=0):
    """(train rows, val rows, tokenizer) for a built-in task; the splits use separate streams."""
    train = make_rows(name, n_train, seed, difficulty, split="train")
    val = make_rows(name, n_val, seed, difficulty, split="test")
    return train, val, build_tokenizer()
