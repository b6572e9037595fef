"""The measuring parts of ``tools/gpu_check.sh`` (one GPU): each prints a short markdown body.

    python tools/gpu_check.py {env,te_vs_local,vllm_roundtrip,bench_kernels}

Exit status: 0 passed, 1 failed (a check outside its tolerance, or an error), 77 skipped (the reason is
the last line printed). The numbers are for the report; the tolerances are deliberately loose where
kernels differ (TF32 off, fp32 TE vs local; bf16 vLLM vs transformers).
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SKIP = 77


class Skip(Exception):
    """A part that cannot run here; the message says why."""


def _which(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


def _need_cuda():
    import torch

    if not torch.cuda.is_available():
        raise Skip("CUDA is not available to torch")
    return torch


def env() -> int:
    """Versions of everything the GPU paths depend on."""
    import platform

    import subprocess
    from importlib import metadata

    print(f"- python {platform.python_version()} ({sys.executable})")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True) if _which("nvidia-smi") else None
    print(f"- nvidia-smi: {smi.stdout.strip() if smi is not None and smi.returncode == 0 else 'not available'}")
    for name in ("torch", "megatron.core", "transformers", "triton", "transformer_engine", "vllm", "flash_attn"):
        try:
            mod = importlib.import_module(name)
            print(f"- {name} {getattr(mod, '__version__', '?')} imports ({os.path.dirname(mod.__file__ or '')})")
        except Exception as e:  # noqa: BLE001 - any failure is reported, not fatal
            print(f"- {name}: does not import ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    for dist in ("megatron-core", "math-verify", "pytest-timeout"):
        try:
            print(f"- {dist} {metadata.version(dist)} (installed metadata)")
        except metadata.PackageNotFoundError:
            print(f"- {dist}: no installed metadata")
    try:
        import torch

        print(f"- torch CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
              f"available={torch.cuda.is_available()}")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"- cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    except Exception as e:  # noqa: BLE001
        print(f"- torch CUDA query failed: {e}")
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN"):
        print(f"- {var}={os.environ.get(var)!r}")
    return 0


# ----------------------------------------------------------------------------- TE spec vs local spec
def _tiny_hf(family: str = "qwen2"):
    from megatron_credit.conversion.testing import tiny_hf_config

    return tiny_hf_config(family, vocab_size=160, num_hidden_layers=2)


def _build_loaded(cfg, hf_state, *, te: bool, dtype, init: bool = False):
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.conversion import family_for_config, load_hf_into_local_state
    from megatron_credit.models import build_gpt_model, transformer_config_from_hf

    # the TE model with the fused kernels the trainer's TE path turns on (models/fused_kernels.py), but the
    # wgrad fusion: it accumulates into DDP's main_grad, and this check reads .grad
    tc = transformer_config_from_hf(cfg, parallel=ParallelConfig(), params_dtype=dtype, perform_initialization=init,
                                    use_cpu_initialization=False, transformer_engine=te,
                                    gradient_accumulation_fusion=False)
    model = build_gpt_model(cfg, tc, use_transformer_engine=te).cuda()
    load_hf_into_local_state(model.state_dict(keep_vars=True), lambda n: hf_state[n].to(dtype), family_for_config(cfg),
                             cfg, tp_rank=0, tp_size=1, layer_offset=0)
    return model


def _loss_and_grads(model, ids, labels, w, u):
    import torch

    from megatron_credit.losses.logprob import logprobs_and_entropy

    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = model(ids, pos, None)
    logp, ent = logprobs_and_entropy(logits, labels)
    (w * logp + u * ent).sum().backward()
    norm = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
            ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight"}

    def local_name(n):
        for te_suffix, local_suffix in norm.items():
            if n.endswith(te_suffix):
                return n[: -len(te_suffix)] + local_suffix
        return n

    grads = {local_name(n): p.grad.float() for n, p in model.named_parameters()}
    return logits.float(), logp.float(), grads


def te_vs_local() -> int:
    """The TE spec against the local spec, same weights, on the invariance batch: logits and gradients."""
    torch = _need_cuda()
    from megatron_credit import distributed
    from megatron_credit.recipe.config import ParallelConfig
    from megatron_credit.models import transformer_engine_available

    if not transformer_engine_available():
        raise Skip("Transformer Engine is not importable")
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    distributed.initialize(ParallelConfig(), seed=0)
    cfg = _tiny_hf()
    torch.manual_seed(0)
    hf_state = AutoModelForCausalLM.from_config(cfg).state_dict()
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 160, (4, 64), generator=g).cuda() for _ in range(2))
    w, u = (torch.randn(4, 64, generator=g).cuda() for _ in range(2))
    ok = True
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 5e-2)):
        outs = {}
        for te in (False, True):
            outs[te] = _loss_and_grads(_build_loaded(cfg, hf_state, te=te, dtype=dtype), ids, labels, w, u)
        (la, pa, ga), (lb, pb, gb) = outs[False], outs[True]
        rel = ((la - lb).abs().max() / la.abs().max()).item()
        dlogp = (pa - pb).abs().max().item()
        grad_rel = max(((ga[n] - gb[n]).abs().max() / ga[n].abs().max().clamp_min(1e-12)).item() for n in ga)
        missing = sorted(set(ga) ^ set(gb))
        good = rel < tol and grad_rel < 20 * tol and not missing
        ok &= good
        print(f"- {dtype}: logits max rel diff {rel:.2e}, logp max abs diff {dlogp:.2e}, "
              f"worst parameter-gradient rel diff {grad_rel:.2e} (tolerance {tol:g} / {20 * tol:g}) "
              f"{'ok' if good else 'FAILED'}{f'; unmatched names {missing[:4]}' if missing else ''}")
    # Skipping init (weights from a checkpoint) must keep the TP attributes on the TE spec too.
    attrs = ("tensor_model_parallel", "partition_dim", "partition_stride")
    want, got = ({n: tuple(getattr(p, a, None) for a in attrs) for n, p in
                  _build_loaded(cfg, hf_state, te=True, dtype=torch.bfloat16, init=init).named_parameters()}
                 for init in (True, False))
    diff = {n: (want[n], got.get(n)) for n in want if want[n] != got.get(n)}
    print(f"- TE spec, perform_initialization=False: TP attributes {'as with init' if not diff else 'DIFFER: ' + str(diff)}")
    distributed.destroy(process_group=True)
    return 0 if ok and not diff else 1


# ------------------------------------------------------------------------------------ vLLM round trip
def vllm_roundtrip() -> int:
    """generate / weight sync / sleep / wake with the vLLM engine; engine vs trainer log-probs."""
    torch = _need_cuda()
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        raise Skip(f"vLLM is not importable: {type(e).__name__}: {e}") from e
    from transformers import Qwen2Config

    from megatron_credit.rollout.weight_sync import group_buckets
    from megatron_credit.rollout import HFRolloutEngine, SamplingParams, logprob_mismatch
    from megatron_credit.rollout.vllm_engine import VLLMRolloutEngine

    cfg = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1e4,
                      initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf = HFRolloutEngine(hf_config=cfg, init_seed=0, dtype=torch.bfloat16, device="cuda")
    path = tempfile.mkdtemp(prefix="gpu_check_qwen2_")
    hf.model.save_pretrained(path)
    prompts = [[3 + i, 17, 42 + i, 8] for i in range(8)]
    t0 = time.perf_counter()
    eng = VLLMRolloutEngine(model_path=path, gpu_memory_utilization=0.3, logprobs_mode="raw",
                            allow_insecure_serialization=True, engine_kwargs={"enforce_eager": True,
                                                                              "max_model_len": 1024})
    print(f"- engine built in {time.perf_counter() - t0:.1f}s (max_model_len {eng.max_model_len})")
    ok = True

    def mismatch(batch, label):
        nonlocal ok
        padded = batch.to_padded(pad_token_id=0)
        with torch.no_grad():
            logits = hf.model(input_ids=padded.input_ids.cuda(), attention_mask=padded.attention_mask.cuda()).logits
        logp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, padded.input_ids[:, 1:, None].cuda())[..., 0]
        trainer = torch.nn.functional.pad(logp, (1, 0)).cpu()
        stats = {k: float(v) for k, v in logprob_mismatch(padded.rollout_logprobs, trainer, padded.response_mask).items()}
        good = stats["mean_abs_diff"] < 0.02
        ok &= good
        print(f"- {label}: {len(batch)} samples, engine vs trainer log-probs "
              + ", ".join(f"{k} {v:.3g}" for k, v in stats.items() if "diff" in k) + ("" if good else " FAILED"))

    params = SamplingParams(max_new_tokens=64, n=4, seed=0, stop_token_ids=[2])
    t0 = time.perf_counter()
    mismatch(eng.generate(prompts, params), f"generate ({time.perf_counter() - t0:.1f}s)")
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in hf.model.state_dict().items()}
    hf.model.load_state_dict(new)
    t0 = time.perf_counter()
    eng.sleep()
    t_sleep = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.wake_up(["weights"])  # the trainer's order: weights woken, synced, then the KV cache
    # The trainer's buckets: whole decoder layers (a bucket never splits a fused q/k/v or gate/up group).
    sent = eng.update_weights(group_buckets(new.items(), bucket_bytes=1))
    t_sync = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.wake_up(["kv_cache"])
    print(f"- sleep {t_sleep:.2f}s, wake of the weights + sync of {sent} tensors {t_sync:.2f}s, "
          f"KV cache wake {time.perf_counter() - t0:.2f}s")
    mismatch(eng.generate(prompts, params), "generate after sleep + wake weights + sync + wake KV")
    greedy = eng.generate(prompts[:2], SamplingParams(temperature=0, n=3, max_new_tokens=16))
    same = all(len({tuple(s.response_ids) for s in greedy.samples[3 * i:3 * i + 3]}) == 1 for i in range(2))
    print(f"- greedy n=3: sample indices {[s.sample_index for s in greedy.samples]}, identical per prompt: {same}")
    eng.close()
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------ benchmarks
def _best_ms(fn, reps=5):
    import torch

    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times[1:]) * 1e3


def published_future_kl(logp, old_logp, mask, *, tau=32.0, c=10.0, k=128):
    """FIPO's published algorithm (as ``benchmarks/credit_kernels.py``, on the inputs' device): per key
    chunk a (T x K) decay matrix and a matmul, O(B T^2)."""
    import math

    import torch

    d = (logp - old_logp).clamp(-20, 20)
    x = torch.where(d <= math.log(c), d, torch.zeros_like(d)) * mask
    gamma = 2.0 ** (-1.0 / tau)
    t = x.shape[1]
    rows = torch.arange(t, dtype=x.dtype, device=x.device)
    out = torch.zeros_like(x)
    for k0 in range(0, t, k):
        cols = torch.arange(k0, min(k0 + k, t), dtype=x.dtype, device=x.device)
        diff = cols[None, :] - rows[:, None]
        decay = torch.where(diff >= 0, gamma ** diff.clamp(min=0), torch.zeros_like(diff))
        out += x[:, k0:k0 + k] @ decay.T
    return out * mask


def _peak_extra_gib(fn) -> tuple[float, float]:
    """(best ms of 3, peak GiB allocated above the start) of ``fn`` on the GPU."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = _best_ms(fn, reps=3)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def bench_kernels() -> int:
    """At T = 20,480, B = 8: Future-KL and the scan (CP 1) against torch.cumsum; the log-prob + entropy
    chunked path at V = 152,064 against the naive one (peak memory); the concentration statistic at
    16K queries x 20K keys against the dense softmax (peak memory)."""
    torch = _need_cuda()
    from megatron_credit.credit.future_kl import future_kl
    from megatron_credit.credit.scan import reverse_linear_scan
    from megatron_credit.losses.logprob import logprobs_and_entropy
    from megatron_credit.models.concentration import attention_concentration

    torch.set_float32_matmul_precision("highest")
    t, b = 20480, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    logp = -torch.rand(b, t, device="cuda", generator=g) * 3
    old = logp - 0.3 * torch.randn(b, t, device="cuda", generator=g)
    mask = torch.ones(b, t, device="cuda")
    coef = torch.rand(b, t, device="cuda", generator=g)
    floor = _best_ms(lambda: torch.cumsum(logp, dim=1))
    ours = _best_ms(lambda: future_kl(logp, old, mask, tau=32.0, dual_clip_c=10.0))
    scan_const = _best_ms(lambda: reverse_linear_scan(logp, 0.97))
    scan_gen = _best_ms(lambda: reverse_linear_scan(logp, coef))
    ref = published_future_kl(logp.double(), old.double(), mask.double())
    err = (future_kl(logp.double(), old.double(), mask.double(), tau=32.0, dual_clip_c=10.0) - ref).abs().max().item()
    print(f"- B={b} T={t} fp32, torch.cumsum {floor:.3f} ms: Future-KL {ours:.2f} ms ({ours / floor:.1f}x cumsum); "
          f"scan (CP 1) constant coefficient {scan_const:.2f} ms ({scan_const / floor:.1f}x), per-token coefficient "
          f"{scan_gen:.2f} ms ({scan_gen / floor:.1f}x); max |Future-KL - published O(T^2)| (fp64) {err:.1e}", flush=True)
    vocab = 152064
    logits = (torch.randn(1, t, vocab, device="cuda", dtype=torch.bfloat16) * 2).requires_grad_()
    labels = torch.randint(0, vocab, (1, t), device="cuda")

    def ours_lp():
        lp, ent = logprobs_and_entropy(logits, labels)
        (lp.sum() + ent.sum()).backward()

    def naive_lp():
        ls = torch.log_softmax(logits.float(), -1)
        lp = ls.gather(-1, labels[..., None])[..., 0]
        ent = -(ls.exp() * ls).sum(-1)
        (lp.sum() + ent.sum()).backward()

    peaks = {}
    for name, fn in (("chunked (ours)", ours_lp), ("naive fp32", naive_lp)):
        try:
            ms, peaks[name] = _peak_extra_gib(fn)
            print(f"- log-prob + entropy fwd+bwd, T={t}, V={vocab}, bf16 logits ({logits.numel() * 2 / 2**30:.1f} GiB): "
                  f"{name} {ms:.1f} ms, peak extra {peaks[name]:.1f} GiB", flush=True)
        except torch.cuda.OutOfMemoryError:
            print(f"- log-prob + entropy: {name}: out of memory")
        logits.grad = None
    del logits
    torch.cuda.empty_cache()
    tq, tk, hq, d = 16384, 20480, 2, 128
    q = torch.randn(1, hq, tq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 1, tk, d, device="cuda", dtype=torch.bfloat16, generator=g)

    def dense():
        s = (q.float() @ k.float().expand(1, hq, tk, d).transpose(-1, -2)) * d ** -0.5
        pos = torch.arange(tk - tq, tk, device="cuda")
        s.masked_fill_(torch.arange(tk, device="cuda")[None, :] > pos[:, None], float("-inf"))
        a = torch.softmax(s, dim=-1)
        return (a * a).sum(-1).mean(1)

    ms_ours, peak_ours = _peak_extra_gib(lambda: attention_concentration(q, k))
    h_ours = attention_concentration(q, k)[0]
    try:
        ms_dense, peak_dense = _peak_extra_gib(dense)
        diff = (dense() - h_ours).abs().max().item()
        dense_txt = f"dense fp32 softmax {ms_dense:.0f} ms, peak extra {peak_dense:.1f} GiB; max |H - dense| {diff:.1e}"
    except torch.cuda.OutOfMemoryError:
        dense_txt, diff = "dense: out of memory", 0.0
    print(f"- concentration, {tq} queries x {tk} keys, {hq} query heads, bf16: ours {ms_ours:.0f} ms, "
          f"peak extra {peak_ours:.2f} GiB; {dense_txt}")
    return 0 if err < 1e-6 and diff < 1e-3 else 1


PARTS = {"env": env, "te_vs_local": te_vs_local, "vllm_roundtrip": vllm_roundtrip, "bench_kernels": bench_kernels}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in PARTS:
        print(f"usage: gpu_check.py {{{','.join(PARTS)}}}", file=sys.stderr)
        return 2
    try:
        return PARTS[argv[0]]()
    except Skip as e:
        print(f"skipped: {e}")
        return SKIP


if __name__ == "__main__":
    sys.exit(main())
