"""benchmarks/bench_attention.py: its steps compute attention and its gradients; a --quick run's output structure."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_attention  # noqa: E402


def _np_attention_and_grads(q, k, v, d_out):
    """Softmax attention over (b, h, t, d) in float64 and the gradients of sum(out * d_out)."""
    q, k, v, d_out = (a.astype(np.float64) for a in (q, k, v, d_out))
    scale = 1.0 / np.sqrt(q.shape[-1])
    s = scale * np.einsum("bhqd,bhkd->bhqk", q, k)
    e = np.exp(s - s.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bhkd->bhqd", p, v)
    d_v = np.einsum("bhqk,bhqd->bhkd", p, d_out)
    d_p = np.einsum("bhqd,bhkd->bhqk", d_out, v)
    d_s = p * (d_p - (d_p * p).sum(-1, keepdims=True))  # softmax Jacobian-vector product
    d_q = scale * np.einsum("bhqk,bhkd->bhqd", d_s, k)
    d_k = scale * np.einsum("bhqk,bhqd->bhkd", d_s, q)
    return out, d_q, d_k, d_v


@pytest.mark.parametrize("name", sorted(bench_attention.STEPS))
def test_steps_compute_attention_and_its_gradients(name):
    """Every timed step (stock, ours, ours in Keras' layout) returns the output and dq, dk, dv of numpy's."""
    bhtd, bthd = bench_attention.attention_inputs(batch=2, heads=3, seq=5, head_dim=4, seed=1)
    want = _np_attention_and_grads(*(t.numpy() for t in bhtd))
    step, layout = bench_attention.STEPS[name]
    got = tf.function(step)(*(bhtd if layout == "bhtd" else bthd))
    assert len(got) == 4
    for g, w in zip(got, want):
        g = g.numpy()
        if layout == "bthd":
            g = g.transpose(0, 2, 1, 3)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_attention_case_refuses_a_size_the_machine_cannot_hold(monkeypatch):
    monkeypatch.setattr(bench_attention, "_mem_available", lambda: 2**30)
    # 6 float32 (4, 8, 4096, 4096) score matrices are 12 GiB: no step is traced or run.
    row = bench_attention.run_attention(4096, bench_attention.FULL, rounds=1, repeats=1)
    assert "12.0 GiB" in row["errors"]["skipped"]
    assert "stock_ms" not in row and "fused_ops" not in row


def test_long_sequences_count_ops_on_a_shorter_step_and_time_fewer_rounds(monkeypatch):
    monkeypatch.setattr(bench_attention, "LONG_SEQ", 8)
    cfg = dict(bench_attention.QUICK, batch=1, heads=2, head_dim=4)
    long_row = bench_attention.run_attention(12, cfg, rounds=5, repeats=4)
    short_row = bench_attention.run_attention(8, cfg, rounds=2, repeats=1)
    assert long_row["errors"] == {} and short_row["errors"] == {}
    assert long_row["ops_counted_at_seq"] == 8 and short_row["ops_counted_at_seq"] == 8
    assert (long_row["rounds"], long_row["repeats"]) == (3, 1)
    assert "fused_bthd_ms" not in long_row and short_row["fused_bthd_ms"] > 0
    assert long_row["stock_ops"] == short_row["stock_ops"] and long_row["fused_ops"] == short_row["fused_ops"]
    assert long_row["max_abs_diff"] < 1e-5 and "max_abs_diff_bthd" not in long_row


def test_encoder_model_has_the_stock_layers():
    model = bench_attention.encoder_classifier(**bench_attention.QUICK["encoder"])
    kinds = {type(layer).__name__ for layer in model.layers}
    assert {"Embedding", "PositionEmbedding", "MultiHeadAttention", "LayerNormalization", "Dense",
            "GlobalAveragePooling1D"} <= kinds
    x = np.zeros((3, bench_attention.QUICK["encoder"]["seq"]), "int32")
    probs = model(x).numpy()
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)  # softmax head


@pytest.mark.slow
def test_quick_run_output(tmp_path):
    """`--quick` in a subprocess: the printed table names the CPU and the path ours ran; the JSON has every case."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_attention.py"), "--quick",
         "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "attention_quick.json").read_text())
    env, state = data["environment"], data["kernel"]
    assert env["cpu"] and f"CPU: {env['cpu']}" in proc.stdout
    assert isinstance(state["uses_kernel"], bool)
    assert f"uses_kernel() = {state['uses_kernel']}" in proc.stdout
    assert data["cases"] == list(bench_attention.CASES)

    rows = data["attention"]
    assert [r["seq"] for r in rows] == list(bench_attention.QUICK["seqs"])
    for r in rows:
        assert r["errors"] == {}, r["errors"]
        for key in ("stock_ops", "fused_ops", "fused_bthd_ops"):
            assert isinstance(r[key], int) and r[key] > 0, key
        for key in ("stock_ms", "fused_ms", "fused_bthd_ms", "fused_speedup", "fused_bthd_speedup",
                    "stock_cpu_ms", "fused_cpu_ms", "fused_cpu_speedup"):
            assert r[key] > 0, key
        assert r["fused_ops_ratio"] == pytest.approx(r["fused_ops"] / r["stock_ops"])
        assert r["stock_einsum_ops"] > 0  # Keras' attention is Einsum-based on TF
        assert (r["fused_attention_ops"] > 0) == state["uses_kernel"]
        assert r["max_abs_diff"] < 1e-4 and r["max_abs_diff_bthd"] < 1e-4  # both compute the same thing

    memory = {r["impl"]: r for r in data["memory"]}
    assert set(memory) == {"stock", "fused"}
    for r in memory.values():
        assert "errors" not in r, r.get("errors")
        assert r["seq"] == bench_attention.QUICK["memory_seq"]
        assert r["peak_mb"] >= r["before_mb"] > 0 and r["step_mb"] == pytest.approx(r["peak_mb"] - r["before_mb"])
        assert isinstance(r["peak_reset"], bool)
    assert memory["fused"]["step_ratio"] == pytest.approx(memory["fused"]["step_mb"] / memory["stock"]["step_mb"])

    encoder = data["encoder"]
    assert encoder[0]["policy"] == "float32" and encoder[0]["stock_ops"] > 0 and encoder[0]["stock_ms"] > 0
    assert "encoder" not in encoder[0]["errors"], encoder[0]["errors"]
    if encoder[0].get("verified") in ("yes", "no (VerificationError)"):
        assert encoder[0]["ours_ops"] > 0 and encoder[0]["speedup"] > 0 and encoder[0]["cpu_speedup"] > 0
    else:  # a refused conversion is recorded, not measured
        assert encoder[0]["errors"]["convert"] and "ours_ops" not in encoder[0]
    skipped = [s["policy"] for s in data["skipped"]]
    assert ("mixed_bfloat16" in skipped) != env["cpu_bf16"]
    assert (tmp_path / "attention_quick.md").read_text().startswith("# attention_quick")
