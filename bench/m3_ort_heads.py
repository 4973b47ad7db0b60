"""One-off measurement behind the ONNX Runtime backend's choice for bge-m3's heads: export them into the graph,
or run the plain export (token states) and apply them in numpy after it. python -m bench.m3_ort_heads
(random XLM-R with bge-m3's hidden size 1024 and 2 layers; prints per-forward medians)."""
from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(hidden: int = 1024, layers: int = 2, shapes=((1, 16), (4, 128), (8, 256)), reps: int = 7) -> None:
    import onnxruntime as ort
    import torch

    from embedops_server.backends.m3 import load_heads, numpy_heads
    from embedops_server.core.batch import Batch
    from embedops_server.core.model_info import load_model_info
    from bench.m3_model import build_m3_folder

    tmp = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, tmp, True)  # its model and exports: tens of MB a run, not kept
    d = build_m3_folder(tmp / "m", hidden=hidden, layers=layers, max_positions=514)
    info = load_model_info(d)
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(d), attn_implementation="eager").eval()
    heads = load_heads(info, None, hidden)
    ws, bs = torch.from_numpy(heads.sparse.weight), torch.from_numpy(heads.sparse.bias)
    wc, bc = torch.from_numpy(heads.colbert.weight), torch.from_numpy(heads.colbert.bias)

    model.requires_grad_(False)

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask).last_hidden_state

    class InGraph(Plain):
        def forward(self, ids, mask):
            h = self.m(input_ids=ids, attention_mask=mask).last_hidden_state
            tw = torch.relu(torch.nn.functional.linear(h, ws, bs)).squeeze(-1)
            cv = torch.nn.functional.linear(h[:, 1:], wc, bc)
            return h[:, 0], tw, cv

    ids = torch.ones((2, 8), dtype=torch.long)
    dyn = {"ids": {0: "b", 1: "s"}, "mask": {0: "b", 1: "s"}}
    paths = {}
    for name, mod, outs in (("plain", Plain(), ["h"]), ("in-graph", InGraph(), ["cls", "tw", "cv"])):
        paths[name] = tmp / f"{name}.onnx"
        with torch.inference_mode():
            torch.onnx.export(mod, (ids, torch.ones_like(ids)), str(paths[name]), input_names=["ids", "mask"],
                              output_names=outs, dynamic_axes={**dyn, **{o: {0: "b"} for o in outs}},
                              opset_version=17, dynamo=False)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    from embedops_server.backends.m3 import OrtHeads

    ort_heads = OrtHeads(heads, lambda model: ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]))
    rng = np.random.default_rng(0)
    print(f"hidden {hidden}, {layers} layers; ms per forward, best of {reps}")
    for rows, cols in shapes:
        x = rng.integers(5, 30000, (rows, cols)).astype(np.int64)
        m = np.ones_like(x)
        batch = Batch(x, m, np.zeros_like(x), m.sum(1), heads=frozenset({"sparse", "colbert"}))

        def plain_dense():
            sess["plain"].run(None, {"ids": x, "mask": m})

        def plain_heads():
            h = sess["plain"].run(None, {"ids": x, "mask": m})[0]
            numpy_heads(heads, batch, h)

        def plain_ort_heads():
            h = sess["plain"].run(None, {"ids": x, "mask": m})[0]
            ort_heads(batch, h)

        def in_graph():
            cls, tw, cv = sess["in-graph"].run(None, {"ids": x, "mask": m})
            from embedops_server.backends.m3 import colbert_rows, lexical_weights
            lexical_weights(x, tw, batch.lengths, rows, heads.unused_ids)
            colbert_rows(cv, batch.lengths, rows)

        h = sess["plain"].run(None, {"ids": x, "mask": m})[0]

        def heads_numpy():
            numpy_heads(heads, batch, h)

        def heads_sessions():
            ort_heads(batch, h)

        res = {}
        for name, fn in (("plain, dense only", plain_dense), ("plain + numpy heads", plain_heads),
                         ("plain + head sessions (server)", plain_ort_heads), ("heads in the graph", in_graph),
                         ("heads alone: numpy", heads_numpy), ("heads alone: sessions", heads_sessions)):
            fn()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1000)
            res[name] = min(ts)  # the least disturbed run: this machine's 2 cores are shared
        print(f"{rows} x {cols}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
