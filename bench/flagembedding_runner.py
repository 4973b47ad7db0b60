"""Runs inside FlagEmbedding's own venv (bench/flagembedding.py): BGEM3FlagModel on a model folder, float32 on
CPU, dense + sparse + ColBERT; writes out.npz and out.json into the given folder. Not imported by the server."""
import sys

sys.path.pop(0)  # this script's folder (bench/): its profile.py would shadow the stdlib module transformers uses

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from FlagEmbedding import BGEM3FlagModel  # noqa: E402

req = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
torch.set_num_threads(max(1, torch.get_num_threads()))
model = BGEM3FlagModel(req["model"], use_fp16=False, devices="cpu", normalize_embeddings=True)
texts = req["texts"]


def run():
    return model.encode(texts, batch_size=req["batch_size"], max_length=req["max_length"], return_dense=True,
                        return_sparse=True, return_colbert_vecs=True)


res = run()
seconds = []
for _ in range(req.get("timing_rounds", 0)):
    t0 = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - t0)
arrays = {"dense": np.asarray(res["dense_vecs"], dtype=np.float32)}
for i, v in enumerate(res["colbert_vecs"]):
    arrays[f"colbert_{i}"] = np.asarray(v, dtype=np.float32)
np.savez(out / "out.npz", **arrays)
sparse = [{str(k): float(v) for k, v in d.items()} for d in res["lexical_weights"]]
(out / "out.json").write_text(json.dumps({"sparse": sparse, "seconds": seconds}))
