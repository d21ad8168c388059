"""The model runner: owns the model, the paged KV cache tensors, the attention backend and the
sampler; turns one `SchedulerOutput` into one forward plus sampling."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend, kv_cache_shape
from engine.attention.checkpoint_pool import CheckpointPool
from engine.attention.host_pool import HostPool, make_host_pool
from engine.attention.hybrid_backend import HybridBackend
from engine.attention.hybrid_runner import make_checkpoint_pool, make_hybrid_backend, make_state_pool
from engine.attention.select import choose_backend, flashinfer_import_error, make_backend
from engine.batch import ForwardBatch
from engine.config import EngineConfig, parse_memory
from engine.core_types import SampledToken
from engine.cuda_graph import CudaGraphRunner, DecodeBuckets, graphs_disabled_reason, verify_graph_query_len
from engine.errors import ConfigError
from engine.host.cpu_kernels import load_cpu_ops
from engine.host.format_timing import LinearShapes
from engine.host.huge_pages import move_to_huge_pages
from engine.input_batch import InputBatch
from engine.models.decoder import DecoderForCausalLM, use_cpu_ops, use_fused_layers
from engine.models.layers import quantized_kernels_only
from engine.prompt_logprobs import PromptLogprobs
from engine.sampler import Sampler
from engine.spec_decode.config import DEFAULT_MAX_BATCH
from engine.spec_decode.mtp import MtpDrafter
from engine.spec_decode.rejection import verify
from engine.spec_decode.rollback import StateSnapshot
from engine.step_result import PendingStep, StepResult, StepTimings
from engine.structured_output.manager import StructuredOutputs
from engine.weights.config.model_config import ModelConfig
from engine.weights.dtype_policy import (
    int8_dense_from_rows,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_quantization,
)
from engine.weights.formats.int4_linear import Int4Linear, cpu_streamed_weights
from engine.weights.formats.int8_linear import use_cpu_gemv
from engine.weights.formats.nvfp4 import QuantizationMethod, detect_quantization
from engine.weights.formats.packed_linear import can_pack, pack_float_linears, packed_bytes
from engine.weights.loader import load_model, weight_bytes
from scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput, StateSave

logger = logging.getLogger("fp4serve.runner")

_DEFAULT_CPU_KV_BYTES = 256 << 20  # the demo model (float32) holds 65k tokens: 16 full contexts
_DEFAULT_GPU_KV_FRACTION = 0.85
_MIB = 1 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    return torch.device(name)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, extra_layers: int = 0) -> int:
    """`extra_layers`: attention layers beside the model's on the same pages (the MTP head's)."""
    return (
        2
        * (cfg.num_kv_layers + extra_layers)
        * cfg.num_kv_heads
        * cfg.head_dim
        * torch.tensor([], dtype=dtype).element_size()
    )


class ModelRunner:
    def __init__(
        self,
        model_path: Path,
        model_config: ModelConfig,
        config: EngineConfig,
        max_model_len: int,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """`structured`: grammar state for requests with `SamplingParams.structured`; None when the
        caller never sends one."""
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        # On CPU the compiled ops load first: int4 linears built at load take our op's layout when it
        # is there, and --quantization auto times the formats with the kernels the model will run.
        cpu_ops_error = load_cpu_ops() if self.device.type == "cpu" else None
        quantization = resolve_quantization(
            config.quantization, config.model, self.device, config.dtype, LinearShapes.of(model_config)
        )
        self.dtype = resolve_dtype(config.dtype, model_config.torch_dtype, self.device, quantization)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.quantization: QuantizationMethod | None = detect_quantization(
            model_path, model_config.quantization, quantization
        )
        if self.quantization is not None and (rows := int8_dense_from_rows(config.quantization, quantization)):
            self.quantization = replace(self.quantization, int8_dense_from_rows=rows)
        if self.quantization is not None:
            logger.info("quantization: %s", self.quantization.describe())
        self.use_mtp = config.speculative_method == "mtp"
        mtp_path = Path(config.speculative_model).expanduser() if config.speculative_model else None
        self.model = load_model(
            model_path,
            model_config,
            self.dtype,
            self.device,
            max_model_len,
            self.quantization,
            mtp=self.use_mtp,
            mtp_path=mtp_path,
        )
        if self.device.type == "cuda":
            # Quantize-at-load temporaries sit in torch's cache, which mem_get_info counts as used.
            torch.cuda.empty_cache()
        if self.device.type == "cpu" and type(self.model) is DecoderForCausalLM:
            if moved := move_to_huge_pages(cpu_streamed_weights(self.model)):
                logger.info(
                    "int4 layers and the int8 lm_head (%.1f MiB) moved into transparent huge pages", moved / _MIB
                )
            if cpu_ops_error is None:
                use_cpu_ops(self.model)
                logger.info("norms, residual adds, SwiGLU and RoPE run as fused CPU ops")
                if fused := use_fused_layers(self.model):
                    logger.info("%d int4 layers run as one C++ op each below their dense copies' rows", fused)
                int4 = [m for m in self.model.modules() if isinstance(m, Int4Linear)]
                if int4:
                    own = sum(m.own_kernel for m in int4)
                    logger.info(
                        "%d int4 linears run our AVX512-BF16 op (kernels/cpu_int4.cpp), %d torch's int4 kernel%s",
                        own,
                        len(int4) - own,
                        "" if own else " (this CPU has no AVX512-BF16)",
                    )
                if use_cpu_gemv(self.model):
                    logger.info("the int8 lm_head runs the compiled int8 op for small batches (kernels/cpu_gemv.cpp)")
            else:
                logger.info("fused CPU ops off (norms, SwiGLU, RoPE run as torch ops): %s", cpu_ops_error)
        if can_pack(self.dtype, self.device):
            num_packed = pack_float_linears(self.model)
            if num_packed:
                logger.info(
                    "%d bf16 linears hold their weights oneDNN-packed (reordered once for its GEMM)", num_packed
                )
        if self.device.type == "cpu":
            self.model.keep_transposed_lm_head()
        footprint = weight_bytes(self.model)
        # Resident weights: NVFP4 packed codes and scales, oneDNN-packed weights and dense copies included.
        self.weight_nbytes = footprint.total + packed_bytes(self.model)
        self.nvfp4_weight_nbytes = footprint.nvfp4
        if footprint.num_nvfp4_linears:
            logger.info(
                "weights: %.2f MiB resident (nvfp4 linears: %.2f MiB in %d layers)",
                footprint.total / _MIB,
                footprint.nvfp4 / _MIB,
                footprint.num_nvfp4_linears,
            )
        elif footprint.num_fp8_linears:
            logger.info(
                "weights: %.2f MiB resident (fp8 linears: %.2f MiB in %d layers)",
                footprint.total / _MIB,
                footprint.fp8 / _MIB,
                footprint.num_fp8_linears,
            )
        else:
            logger.info(
                "weights: %.2f MiB resident (%s)", self.weight_nbytes / _MIB, str(self.dtype).removeprefix("torch.")
            )
        if self.model.lm_head_t is not None:
            logger.info(
                "plus %.2f MiB: a transposed lm_head copy for the CPU logits matmul", self.model.lm_head_t.nbytes / _MIB
            )
        # Hybrid models: the state slots first, so that on CUDA the KV pages fit in what is left.
        self.state_pool = make_state_pool(model_config, config, self.device)
        self.num_state_slots = self.state_pool.num_slots if self.state_pool is not None else 0
        # Hybrid prefix caching's checkpoints: on CUDA sized from free memory before the KV pages,
        # on CPU after them (at most one per page).
        on_cuda = self.device.type == "cuda"
        page_shape = kv_cache_shape(1, self.block_size, model_config.num_kv_heads, model_config.head_dim)[1:]

        def checkpoints(num_kv_pages: int | None) -> tuple[CheckpointPool | None, int]:
            return make_checkpoint_pool(
                model_config,
                config,
                self.device,
                page_shape,
                model_config.num_kv_layers + int(self.use_mtp),
                self.dtype,
                num_kv_pages,
                max_model_len,
            )

        self.checkpoint_pool, self.state_checkpoint_bits = checkpoints(None) if on_cuda else (None, 0)
        self.num_kv_pages = self._num_kv_pages()
        if not on_cuda:
            self.checkpoint_pool, self.state_checkpoint_bits = checkpoints(self.num_kv_pages)
        self.num_state_checkpoints = self.checkpoint_pool.num_checkpoints if self.checkpoint_pool is not None else 0
        # One page more than the scheduler gets: the scratch page padded CUDA-graph rows write to.
        scratch_page = self.num_kv_pages
        shape = kv_cache_shape(self.num_kv_pages + 1, self.block_size, model_config.num_kv_heads, model_config.head_dim)
        # one [num_pages + 1, 2, block_size, Hkv, D] tensor per layer, model dtype, on the device
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(model_config.num_kv_layers)
        ]
        name = choose_backend(
            config.attention_backend,
            self.device,
            flashinfer_import_error(self.device) is None,
            dtype=self.dtype,
            head_dim=model_config.head_dim,
            kv_dtype=self.kv_dtype,
        )
        self.backend: AttentionBackend = make_backend(name, model_config, self.dtype, self.device, self.block_size)
        if self.state_pool is not None:
            self.backend = make_hybrid_backend(self.backend, self.state_pool, config, self.device, self.checkpoint_pool)
        self.drafter: MtpDrafter | None = None
        if self.use_mtp:
            assert isinstance(self.backend, HybridBackend), "MTP needs a hybrid model"
            self.drafter = MtpDrafter(
                self.model,
                self.backend,
                self.num_kv_pages,
                self.block_size,  # type: ignore[arg-type]
                config.max_num_seqs,
                config.num_speculative_tokens,
                config.speculative_max_batch or DEFAULT_MAX_BATCH,
                self.dtype,
                self.device,
            )
            logger.info(
                "MTP drafting on: the mtp head's KV is one more attention layer on the same pages "
                "(%.2f MiB, counted in the KV budget) plus %.2f MiB of draft scratch pages",
                self.drafter.kv_cache.nbytes / _MIB - self.drafter.scratch_nbytes / _MIB,
                self.drafter.scratch_nbytes / _MIB,
            )
        self.host_pool: HostPool | None = make_host_pool(  # --kv-offloading-size
            config.kv_offloading_size,
            config.enable_prefix_caching,
            self._checkpointed_kv(),
            self.num_kv_pages,
            self.checkpoint_pool,
            self.state_pool,
            self.device,
        )
        self.graphs = CudaGraphRunner(
            self.model,
            self.kv_caches,
            self.backend,
            DecodeBuckets.up_to(config.max_num_seqs),
            scratch_page=scratch_page,
            max_pages_per_seq=-(-max_model_len // self.block_size),
            verify_query_len=verify_graph_query_len(config, self.block_size),
        )
        why_not = graphs_disabled_reason(config.enforce_eager, self.device, self.backend)
        if why_not is None:
            self.graphs.capture()
        else:
            logger.info("decode CUDA graphs off: %s", why_not)
        self.sampler = Sampler(model_config.vocab_size, self.device)
        self.prompt_logprobs = PromptLogprobs()
        self.structured = structured
        # The last step's sampled ids ([S] int64, device) and each request's row in them: the
        # next step's placeholders are filled from these (async scheduling).
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.input_batch = InputBatch(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            -(-max_model_len // self.block_size),
            self.block_size,
            self.device,
        )

    def _num_kv_pages(self) -> int:
        per_page = kv_bytes_per_token(self.model_config, self.kv_dtype, int(self.use_mtp)) * self.block_size
        spec = self.config.kv_cache_memory
        num_bytes, fraction = parse_memory(spec) if spec else (None, None)
        if num_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                num_bytes = int(free * (fraction or _DEFAULT_GPU_KV_FRACTION))
            elif fraction is not None:
                raise ConfigError("--kv-cache-memory: a fraction needs a GPU; give bytes on CPU (e.g. 1GiB)")
            else:
                num_bytes = _DEFAULT_CPU_KV_BYTES
        pages = num_bytes // per_page
        if pages < 2:
            raise ConfigError(f"--kv-cache-memory: {num_bytes} bytes hold fewer than 2 pages of {per_page} bytes")
        return int(pages)

    @property
    def attention_backend_name(self) -> str:
        return self.backend.name

    def execute(self, out: SchedulerOutput) -> StepResult:
        """One step, read back at once (the synchronous engine loop)."""
        return self._launch(out, overlap=False).result()

    def launch(self, out: SchedulerOutput) -> PendingStep:
        """One step, its read-back deferred (async scheduling): on CUDA this returns while the
        device still computes, and the next step's placeholders take its ids on the device."""
        return self._launch(out, overlap=True)

    @torch.inference_mode()
    def _launch(self, out: SchedulerOutput, overlap: bool) -> PendingStep:
        t0 = time.perf_counter()
        for request_id in out.finished_request_ids:
            self.input_batch.remove_request(request_id)
            self.sampler.remove_request(request_id)
            self.prompt_logprobs.remove_request(request_id)
            if self.drafter is not None:
                self.drafter.remove_request(request_id)
            if self.structured is not None:
                self.structured.remove_request(request_id)
        for r in out.requests:
            if r.new_request is not None:
                nr = r.new_request
                self.sampler.add_request(r.request_id, nr.params, nr.prompt_token_ids, nr.eos_token_ids)
                self.prompt_logprobs.add_request(r.request_id, nr.prompt_token_ids, nr.params.prompt_logprobs)
                if self.drafter is not None:
                    self.drafter.add_request(r.request_id, nr.prompt_token_ids, nr.params.speculative)
                if nr.params.structured is not None:
                    assert self.structured is not None, "a grammar request reached a runner without StructuredOutputs"
                    # Compiles in the background while this request's prompt runs.
                    self.structured.add_request(
                        r.request_id, nr.params.structured, nr.eos_token_ids + nr.params.stop_token_ids
                    )
        if out.is_empty:
            return PendingStep(StepResult({}, StepTimings(time.perf_counter() - t0, 0.0, 0.0)))
        batch = self.input_batch.build(out)
        self._fill_placeholders(out, batch)
        if self.host_pool is not None:  # spills before anything in the step writes their pages and checkpoints
            self.host_pool.spill(out.host_copies)
        if self.checkpoint_pool is not None:
            self._restore_checkpoints(out)
        if self.host_pool is not None:  # loads after the state saves (their slots and pages may be reused)
            self.host_pool.load(out.host_copies, self.state_pool)
        verifying = [r for r in out.requests if r.num_draft_tokens]
        snapshot = None
        if verifying and self.state_pool is not None:
            snapshot = StateSnapshot(self.state_pool, [r.state_slot for r in verifying if r.state_slot is not None])
        t1 = time.perf_counter()
        # A verify step without prefill chunks keeps every row on the quantized kernels, as one-row
        # steps run them: greedy output stays what it is without speculation (quantized_kernels_only).
        exact = bool(verifying) and all(r.num_new_tokens == r.num_draft_tokens + 1 for r in out.requests)
        with quantized_kernels_only(exact):
            hidden = self.graphs.forward(batch)  # plans attention, then a graph replay or the eager forward
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [S, vocab] float32
        prompt_logprobs = self.prompt_logprobs.compute(out, hidden, self.model.compute_logits)
        # Host work that overlaps the GPU's forward: the grammar bitmask of constrained rows.
        ids = batch.sample_request_ids
        if verifying:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t2 = time.perf_counter()
            drafts = [r.token_ids[len(r.token_ids) - r.num_draft_tokens :] for r in out.requests if r.sample]
            emitted = dict(zip(ids, verify(self.sampler, self.structured, logits, ids, drafts)))
            rejected = [r for r in verifying if len(emitted[r.request_id]) <= r.num_draft_tokens]
            rolled_back: frozenset[str] = frozenset()
            if snapshot is not None:
                snapshot.restore([r.state_slot for r in rejected if r.state_slot is not None])
                rolled_back = frozenset(r.request_id for r in rejected)
            sampled_first = {rid: toks[0] for rid, toks in emitted.items()}
            self._last_sampled = None  # no placeholder follows a verifying step
            t3 = time.perf_counter()
            self._draft(out, batch, hidden, emitted, rolled_back)
            self._save_step_ends(out)
            timings = StepTimings(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
            # Prefill rows of other requests in this batch may still score prompt tokens.
            return PendingStep(
                StepResult(sampled_first, timings, prompt_logprobs, emitted=emitted, rolled_back=rolled_back)
            )
        grammar_mask = self.structured.mask(ids, self.device) if self.structured is not None and ids else None
        if self.device.type == "cuda" and not overlap:
            torch.cuda.synchronize(self.device)  # attribute GPU time to the forward
        t2 = time.perf_counter()
        launched = self.sampler.launch(logits, ids, grammar_mask) if ids else None
        self._last_sampled = (launched.token_ids, {rid: i for i, rid in enumerate(ids)}) if launched else None
        timings = StepTimings(t1 - t0, t2 - t1, time.perf_counter() - t2)

        def read() -> StepResult:
            sampled = launched.read() if launched is not None else []
            return StepResult(dict(zip(ids, sampled)), timings, prompt_logprobs)

        if grammar_mask is None and self.drafter is None:
            self._save_step_ends(out)
            return PendingStep(read, timings)
        # The grammar and the MTP drafter need this step's tokens on the host now.
        result = read()
        sampled = [result.sampled[rid] for rid in ids]
        if grammar_mask is not None and self.structured is not None:
            self.structured.accept(ids, [tok.token_id for tok in sampled])
        t3 = time.perf_counter()
        self._draft(out, batch, hidden, {rid: (tok,) for rid, tok in zip(ids, sampled)})
        self._save_step_ends(out)
        return PendingStep(replace(result, timings=replace(timings, sample=t3 - t2, draft=time.perf_counter() - t3)))

    def _fill_placeholders(self, out: SchedulerOutput, batch: ForwardBatch) -> None:
        """Async scheduling: a request's last token may be the one the previous step sampled, not
        read back yet; it is taken from that step's ids on the device (no host round-trip)."""
        dst: list[int] = []
        src: list[int] = []
        row = 0
        for r in out.requests:
            row += r.num_new_tokens
            if r.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert r.num_draft_tokens == 0 and self._last_sampled is not None, (
                    f"{r.request_id}: no step to fill from"
                )
                assert r.token_ids.count(PLACEHOLDER_TOKEN_ID) == 1, f"{r.request_id}: more than one step in flight"
                dst.append(row - 1)
                src.append(self._last_sampled[1][r.request_id])
        if dst:
            assert self._last_sampled is not None
            index = torch.tensor(dst, dtype=torch.int64).to(self.device, non_blocking=True)
            source = torch.tensor(src, dtype=torch.int64).to(self.device, non_blocking=True)
            batch.input_ids.index_copy_(0, index, self._last_sampled[0].index_select(0, source))

    def _draft(
        self,
        out: SchedulerOutput,
        batch: ForwardBatch,
        hidden: torch.Tensor,
        emitted: dict[str, tuple[SampledToken, ...]],
        rolled_back: frozenset[str] = frozenset(),
    ) -> None:
        """MTP: fill its KV for this step's rows and draft for the next step (engine/spec_decode/mtp.py)."""
        if self.drafter is None:
            return
        self.drafter.step(
            out,
            batch,
            hidden,
            {rid: [t.token_id for t in toks] for rid, toks in emitted.items()},
            replan=self.graphs.graph_size_for(batch) is not None,
            skip=rolled_back,
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- hybrid prefix caching: state checkpoints ---------------------------------------------------
    def _checkpointed_kv(self) -> list[torch.Tensor]:
        """Every attention layer's KV cache a checkpoint's partial page covers (the MTP head's too)."""
        return self.kv_caches + ([self.drafter.kv_cache] if self.drafter is not None else [])

    def _save_states(self, saves: tuple[StateSave, ...]) -> None:
        """Slot (and partial page) -> checkpoint copies."""
        pool, slots = self.checkpoint_pool, self.state_pool
        assert pool is not None and slots is not None, "state saves without a checkpoint pool"
        pool.save(slots, [s.checkpoint_id for s in saves], [s.state_slot for s in saves])
        paged = [s for s in saves if s.kv_page is not None]
        pool.save_pages(self._checkpointed_kv(), [s.checkpoint_id for s in paged], [s.kv_page for s in paged])  # type: ignore[misc]

    def _restore_checkpoints(self, out: SchedulerOutput) -> None:
        """Before the forward: the states of sequences that finished or were preempted go to their
        checkpoints first (their slots and pages may be reused this step), then the requests that
        start from a checkpoint get its state and, past its full pages, its partial page's KV."""
        pool, slots = self.checkpoint_pool, self.state_pool
        assert pool is not None and slots is not None, "restores without a checkpoint pool"
        if out.state_saves:
            self._save_states(out.state_saves)
        restoring = [r for r in out.requests if r.restore_checkpoint is not None]
        if not restoring:
            return
        pool.restore(slots, [r.restore_checkpoint for r in restoring], [r.state_slot for r in restoring])  # type: ignore[misc]
        bs = self.block_size
        partial = [r for r in restoring if r.start_pos % bs]
        pool.restore_pages(
            self._checkpointed_kv(),
            [r.restore_checkpoint for r in partial],  # type: ignore[misc]
            [r.block_table[r.start_pos // bs] for r in partial],
        )

    def _save_step_ends(self, out: SchedulerOutput) -> None:
        """After the forward (and the MTP fill): the states kept at the end of a request's rows are
        its slot's, plus the KV of the page they end inside."""
        if self.checkpoint_pool is None:
            return
        bs = self.block_size
        saves = tuple(
            StateSave(s.checkpoint_id, r.state_slot, r.block_table[r.seq_len // bs] if r.seq_len % bs else None)
            for r in out.requests
            if r.state_slot is not None
            for s in r.checkpoint_saves
            if s.num_tokens == r.seq_len
        )
        if saves:
            self._save_states(saves)
