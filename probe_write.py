"""Scratch: on the 8B shape, a 32-row decode loop; between some steps a stage (host->device copy) or a slot
write (install); the loop intervals that follow each, and whether the pool's buffers moved."""
import sys, os, time, tempfile
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "bench")
from jlora import Engine, testing
from jlora.scheduler import Request
from model import llama3_8b, llama3_8b_hf, random_model

def main():
    tiny = jax.default_backend() == "cpu"
    root = tempfile.mkdtemp()
    if tiny:
        hf = testing.tiny_config("llama", vocab_size=256)
        testing.write_model(f"{root}/m", hf, seed=0)
        engine = Engine.from_pretrained(f"{root}/m", dtype="bfloat16", max_loras=8, max_lora_rank=64, max_seq_len=1024, progress=False)
    else:
        hf = llama3_8b_hf(32)
        model_def, params = random_model(llama3_8b(32))
        engine = Engine(model_def.merge(params), dtype=jnp.bfloat16, max_loras=8, max_lora_rank=64, max_seq_len=1024)
    for i in range(6):
        testing.write_adapter(f"{root}/a{i}", hf, r=16 * (1 + i % 2), alpha=32, seed=i, target_modules=["q_proj", "v_proj"])
    names = [f"a{i}" for i in range(4)]
    for n in names:
        engine.load_adapter(n, f"{root}/{n}")
    engine._make_resident(names)
    engine.pool.hold(names)
    prepared = [engine.pool.prepare(f"{root}/a{i}") for i in (4, 5)]
    engine.pool.install("x", engine.pool.stage(prepared[0]))
    batcher = engine.new_batcher(32, 1024)
    for r in range(32):
        batcher.add(Request([1 + r, 2, 3], engine.pool.slot(names[r % 4]), 700))
    ptr = lambda: [x.unsafe_buffer_pointer() for x in jax.tree.leaves(engine.pool.weights)]
    events, ivals, last, moved = {}, [], None, []
    for k in range(600):
        what = None
        if k > 100 and k % 25 == 10:
            staged, what = engine.pool.stage(prepared[k % 2]), "stage"
        if k > 100 and k % 25 == 20:
            before = ptr()
            engine.pool.unload("x"); engine.pool.install("x", staged); what = "write"
            moved.append(sum(a != b for a, b in zip(before, ptr())))
        t = time.perf_counter()
        batcher.step()
        now = time.perf_counter()
        if last is not None:
            ivals.append(now - last)
        last = now
        if what and ivals: events[len(ivals) - 1] = what
    iv = np.array(ivals) * 1e3
    after = {w: [iv[i + d] for i, x in events.items() if x == w for d in (0,) if i + d < len(iv)] for w in ("stage", "write")}
    after1 = {w: [iv[i + 1] for i, x in events.items() if x == w if i + 1 < len(iv)] for w in ("stage", "write")}
    quiet = [iv[i] for i in range(100, len(iv)) if i not in events and i - 1 not in events]
    print(f"quiet p50 {np.median(quiet):.2f} p99 {np.percentile(quiet, 99):.2f} ms")
    for w in after:
        print(f"{w}: interval with it p50 {np.median(after[w]):.2f} max {max(after[w]):.2f}; next p50 {np.median(after1[w]):.2f} max {max(after1[w]):.2f} ms")
    print("leaves", len(ptr()), "moved per write", moved[:8])

if __name__ == "__main__":
    main()
