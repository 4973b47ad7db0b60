"""Sizing by the operator: memory estimated from the model's geometry and the spec, used for default requests,
refusals, the prepare step's limit and the status; OOMKilled and the served commit in the status."""
from __future__ import annotations

import copy
import datetime as dt
import json

from embedops_operator import memory as M
from embedops_operator import render as R
from embedops_operator import spec as S
from embedops_operator import status as ST
from embedops_operator.validate import defaulted
from embedops_server import sizing
from tests.unit.operator_helpers import MIG, by_kind, container, es, pod_spec

from .test_operator_status import NOW, conds, deployment

# the seed's CPU ingestion service (examples/bge-m3-cpu-ingestion.yaml)
INGEST = {"model": {"id": "BAAI/bge-m3", "quantize": "int8", "maxInputLength": 512},
          "accelerator": {"cpu": {"cores": 4}}, "batching": {"maxBatchTokens": 8192}}


def parsed(spec: dict) -> S.EmbeddingServiceSpec:
    return S.parse(defaulted(es(spec))).spec


def render(spec: dict) -> list[dict]:
    return R.render(defaulted(es(spec)))


def test_catalog_geometry_gives_bge_m3s_parameter_count():
    g, source = M.geometry(parsed(INGEST))
    assert source == "catalog bge-m3" and abs(g.parameters - 566.7e6) < 0.5e6  # the real model's count
    assert (g.layers, g.hidden, g.heads, g.vocab, g.max_positions) == (24, 1024, 16, 250002, 8192)
    local = copy.deepcopy(INGEST)
    local["model"]["id"] = "/models/bge-m3"  # a local folder named like the model
    assert M.geometry(parsed(local))[0] == g


def test_config_parameter_count_matches_the_built_model():
    """Geometry.from_config counts what transformers builds (bench/real_size.py's model: 566,704,128 with
    type_vocab_size 1 and no pooler)."""
    cfg = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
           "vocab_size": 250002, "max_position_embeddings": 8194, "type_vocab_size": 1}
    assert abs(sizing.Geometry.from_config(cfg).parameters - 566_704_128) < 1e5


def test_cpu_default_memory_comes_from_the_estimate_and_the_prepare_step_may_burst():
    out = render(INGEST)
    c, pod = container(out), pod_spec(out)
    est = R.sizing_of(parsed(INGEST))
    mem = c["resources"]["limits"]["memory"]
    assert c["resources"]["requests"]["memory"] == mem
    assert est.replica.total < sizing.parse_quantity(mem) <= 2 * 2 ** 30  # the 2 GB peak target
    assert c["args"][c["args"].index("--max-input-length") + 1] == "512"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TOKENIZATION_WORKERS"] == "1" and env["ONNX_CACHE"] == R.ONNX_CACHE  # one 110 MB tokenizer
    prep = next(i for i in pod["initContainers"] if i["name"] == "prepare")
    assert prep["command"] == ["embedops-server", "prepare"] and prep["args"] == c["args"]
    assert prep["resources"]["requests"] == c["resources"]["requests"]  # scheduling as the server
    assert sizing.parse_quantity(prep["resources"]["limits"]["memory"]) >= est.prepare
    # the cache: its own volume (not the 2Gi /tmp), written by prepare, read-only for the server
    cache = next(v for v in pod["volumes"] if v["name"] == "onnx-cache")
    assert sizing.parse_quantity(cache["emptyDir"]["sizeLimit"]) >= est.cache
    assert {"name": "onnx-cache", "mountPath": R.ONNX_CACHE, "readOnly": True} in c["volumeMounts"]
    assert {"name": "onnx-cache", "mountPath": R.ONNX_CACHE} in prep["volumeMounts"]


def test_an_answer_cache_is_a_flag_and_memory_and_not_a_new_space():
    """spec.answerCache (issue 56): the server's --answer-cache-bytes, its bytes added to the replica's estimate
    (and so its request and limit; a user's memory below that is refused), host memory on a GPU replica; the
    vectors do not change, so it rolls in place (the same space key)."""
    from embedops_operator import spaces
    from embedops_server.settings import Settings as ServerSettings

    cached = copy.deepcopy(INGEST)
    cached["answerCache"] = {"size": "512Mi"}
    plain, with_cache = container(render(INGEST)), container(render(cached))
    args = with_cache["args"]
    assert args[args.index("--answer-cache-bytes") + 1] == str(512 << 20)
    assert "--answer-cache-bytes" not in plain["args"]
    ServerSettings(**{"model_id": "x", "answer_cache_bytes": int(args[args.index("--answer-cache-bytes") + 1])})
    grown = sizing.parse_quantity(with_cache["resources"]["limits"]["memory"]) - \
        sizing.parse_quantity(plain["resources"]["limits"]["memory"])
    assert 512 << 20 <= grown <= (512 << 20) * 1.25 + (256 << 20)  # the estimate's headroom, rounded up
    est = R.sizing_of(parsed(cached))
    assert est.replica.answer_cache == 512 << 20 and "answer cache 0.50 GiB" in est.replica.describe()
    deployment = lambda out: next(m for m in out if m["kind"] == "Deployment")  # noqa: E731
    assert spaces.key_of(spaces.declaration(deployment(render(INGEST)))) == \
        spaces.key_of(spaces.declaration(deployment(render(cached))))
    gpu = {"model": {"id": "BAAI/bge-m3"}, "accelerator": {"mig": {"profile": "1g.10gb"}},
           "answerCache": {"size": "512Mi"}}
    assert container(render(gpu))["resources"]["limits"]["memory"] == "8704Mi"


def test_a_cache_claim_outlives_pods():
    spec = copy.deepcopy(INGEST)
    spec["model"]["cache"] = {"claimName": "bge-m3-onnx", "subPath": "cpu"}
    pod = pod_spec(render(spec))
    assert {"name": "onnx-cache", "persistentVolumeClaim": {"claimName": "bge-m3-onnx"}} in pod["volumes"]
    prep = next(i for i in pod["initContainers"] if i["name"] == "prepare")
    assert {"name": "onnx-cache", "mountPath": R.ONNX_CACHE, "subPath": "cpu"} in prep["volumeMounts"]


def test_longest_input_decides_cpu_memory():
    """Eager attention holds heads x length^2 scores: without maxInputLength bge-m3 accepts 8192 tokens and
    needs about 10x the memory of a 512-token service."""
    long = copy.deepcopy(INGEST)
    del long["model"]["maxInputLength"]
    short, full = R.sizing_of(parsed(INGEST)).replica, R.sizing_of(parsed(long)).replica
    assert "8192-token input" in full.detail and full.total > 8 * short.total


def test_memory_below_the_estimate_is_refused_with_what_it_needs():
    spec = copy.deepcopy(INGEST)
    spec["accelerator"]["cpu"]["memory"] = "1Gi"
    reason, msg = M.refusal(parsed(spec), R.sizing_of(parsed(spec)))
    assert reason == "InsufficientMemory" and "accelerator.cpu.memory is 1Gi" in msg and "maxInputLength" in msg
    spec["accelerator"]["cpu"]["memory"] = "2Gi"
    assert M.refusal(parsed(spec), R.sizing_of(parsed(spec))) is None
    # the status of a refused service: Stalled, with the reason and the estimate
    res = defaulted(es(spec))
    obs = ST.Observed(refused=("InsufficientMemory", "needs more"))
    st = ST.compute(res, obs, R.Options(), now=NOW)
    assert conds(st)["Stalled"] == ("True", "InsufficientMemory") and conds(st)["Ready"][0] == "False"
    assert st["memory"]["estimate"].endswith("Mi") and st["memory"]["limit"] == "2Gi"


def test_bge_m3_fp16_fits_a_1g_10gb_slice_and_a_huge_budget_does_not():
    est = R.sizing_of(parsed(MIG))
    assert 2.0 * 2 ** 30 < est.replica.total < 3.0 * 2 ** 30  # the seed's ~2.5 GB per replica
    # GPU memory only: the host's tokenizers (110 MB each for XLM-R's vocabulary) are not in the slice
    assert est.replica.tokenizers == 0
    assert est.replica.total == est.replica.runtime + est.replica.weights + est.replica.activations
    assert M.refusal(parsed(MIG), est) is None
    huge = copy.deepcopy(MIG)
    huge["model"]["maxInputLength"] = 8192
    huge["batching"] = {"maxBatchTokens": 262144}
    reason, msg = M.refusal(parsed(huge), R.sizing_of(parsed(huge)))
    assert reason == "ExceedsMIGSlice" and "1 x 1g.10gb" in msg


def test_unknown_model_keeps_the_old_default_and_says_why():
    spec = {"model": {"id": "acme/secret-encoder"}, "accelerator": {"cpu": {"cores": 2}}}
    c = container(render(spec))
    assert c["resources"]["limits"]["memory"] == "4Gi"
    st = ST.compute(defaulted(es(spec)), ST.Observed(), R.Options(), now=NOW)
    assert "model.geometry" in st["memory"]["detail"]
    spec["model"]["geometry"] = {"hiddenSize": 384, "layers": 6, "heads": 12, "vocabSize": 30522}
    assert R.sizing_of(parsed(spec)) is not None
    assert sizing.parse_quantity(container(render(spec))["resources"]["limits"]["memory"]) < 4 * 2 ** 30


def _pod(name, *, ready=True, init=None, server=None, created="2026-01-01T11:00:00Z"):
    spec = {"initContainers": [{"name": "prepare", "resources": {"limits": {"memory": "11Gi"}}}],
            "containers": [{"name": "server", "resources": {"limits": {"memory": "2Gi"}}}]}
    st = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if init is not None:
        st["initContainerStatuses"] = [init]
    if server is not None:
        st["containerStatuses"] = [server]
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec, "status": st}


def test_oomkilled_shows_as_such_with_the_limit_and_the_estimate():
    server = {"name": "server", "restartCount": 3,
              "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
              "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}
    res = defaulted(es(INGEST))
    obs = ST.Observed(deployment=deployment(replicas=1, ready=0, updated=1), pods=[_pod("p", ready=False, server=server)])
    st = ST.compute(res, obs, R.Options(), now=NOW)
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "OOMKilled" and conds(st)["Stalled"] == ("True", "OOMKilled")
    assert "its limit is 2Gi" in ready["message"] and "the operator estimates" in ready["message"]
    # a crash loop names what the server said on its way out (its termination message)
    said = {"name": "server", "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"reason": "Error", "exitCode": 3,
                                         "message": "model loading failed: /models/x has no tokenizer.json"}}}
    obs.pods = [_pod("p", ready=False, server=said)]
    ready = next(c for c in ST.compute(res, obs, R.Options(), now=NOW)["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "CrashLoop" and "has no tokenizer.json" in ready["message"]


def test_status_reports_the_commit_the_newest_ready_pod_serves():
    sha_old, sha_new = "1" * 40, "2" * 40

    def prepared(sha):
        report = {"commit": sha, "graph": "model.int8.onnx", "int8_cosine": 0.9967, "seconds": 1.2,
                  "peak_rss_mb": 310}
        return {"name": "prepare", "state": {"terminated": {"reason": "Completed", "exitCode": 0,
                                                            "message": "prepared " + json.dumps(report)}}}

    pods = [_pod("old", init=prepared(sha_old), created="2026-01-01T10:00:00Z"),
            _pod("new", init=prepared(sha_new), created="2026-01-01T11:00:00Z"),
            _pod("newest-not-ready", ready=False, init=prepared("3" * 40), created="2026-01-01T11:30:00Z")]
    st = ST.compute(defaulted(es(INGEST)), ST.Observed(deployment=deployment(), pods=pods), R.Options(), now=NOW)
    assert st["model"]["commit"] == sha_new and "int8_cosine 0.9967" in st["model"]["prepared"]


def test_status_names_the_space_the_ready_replicas_serve_and_says_when_they_disagree():
    def prepared(space):
        report = {"commit": None, "space": space, "graph": "model.onnx"}
        return {"name": "prepare", "state": {"terminated": {"reason": "Completed", "exitCode": 0,
                                                            "message": "prepared " + json.dumps(report)}}}

    same = [_pod(n, init=prepared("aaaa000011112222"), created=f"2026-01-01T1{i}:00:00Z") for i, n in enumerate("ab")]
    st = ST.compute(defaulted(es(INGEST)), ST.Observed(deployment=deployment(), pods=same), R.Options(), now=NOW)
    assert st["model"]["space"] == "aaaa000011112222" and "space" not in st["model"]["prepared"]
    mixed = same + [_pod("c", init=prepared("bbbb000011112222"), created="2026-01-01T13:00:00Z"),
                    _pod("d", ready=False, init=prepared("cccc000011112222"), created="2026-01-01T14:00:00Z")]
    st = ST.compute(defaulted(es(INGEST)), ST.Observed(deployment=deployment(), pods=mixed), R.Options(), now=NOW)
    assert st["model"]["space"] == "bbbb000011112222,aaaa000011112222"  # newest first; a pod not ready serves nothing


def test_rollout_override_lets_one_gpu_replica_surge():
    spec = copy.deepcopy(MIG)
    spec["rollout"] = {"maxSurge": 1, "maxUnavailable": 0}
    assert by_kind(render(spec))["Deployment"]["spec"]["strategy"]["rollingUpdate"] == \
        {"maxSurge": 1, "maxUnavailable": 0}
    spec["rollout"] = {"maxSurge": "25%"}  # the other field keeps the default (a surge)
    assert by_kind(render(spec))["Deployment"]["spec"]["strategy"]["rollingUpdate"] == \
        {"maxSurge": "25%", "maxUnavailable": 0}


def test_printer_columns_show_memory_and_commit_wide():
    cols = {c["name"]: c for c in S.crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert cols["Memory"]["jsonPath"] == ".status.memory.estimate" and cols["Memory"]["priority"] == 1
    assert cols["Commit"]["jsonPath"] == ".status.model.commit"


def test_colbert_outputs_count_the_responses_a_replica_holds():
    """ColBERT answers one 1024-float vector per token: two full requests' vectors (maxClientBatchSize x the
    longest input) are in the estimate when colbert is served, on CPU; dense and sparse add nothing, and on a
    GPU the vectors are host memory, not the slice's."""
    def with_outputs(spec: dict, outputs: list[str] | None, batch: int = 64) -> dict:
        s = copy.deepcopy(spec)
        s["model"]["outputs"] = outputs
        s["batching"] = {**s.get("batching", {}), "maxClientBatchSize": batch}
        return s
    # revision 5: ColBERT's alone (revision 6 counts /embed_all's too: the next test)
    plain = R.sizing_of(parsed(with_outputs(INGEST, ["dense", "sparse"])), 5).replica
    hybrid = R.sizing_of(parsed(with_outputs(INGEST, ["dense", "sparse", "colbert"])), 5).replica
    assert plain.responses == 0 and plain.total == R.sizing_of(parsed(INGEST), 5).replica.total
    held = sizing.RESPONSES_IN_FLIGHT * 64 * 512 * 1024 * 4 * sizing.RESPONSE_BYTES_PER_OUTPUT_BYTE
    assert hybrid.responses == int(held) and hybrid.serving - plain.serving == hybrid.responses
    # int8: without ColBERT answers the loading peak (the weights' packed copies) is the larger; with them the
    # answers are
    assert plain.loading > plain.serving
    assert plain.total == plain.runtime + plain.tokenizers + plain.weights + plain.loading
    assert hybrid.total == hybrid.runtime + hybrid.tokenizers + hybrid.weights + hybrid.serving
    assert "answers of every token's state" in hybrid.describe() and "answers" not in plain.describe()
    smaller = R.sizing_of(parsed(with_outputs(INGEST, ["dense", "sparse", "colbert"], batch=16)), 5).replica
    assert smaller.responses * 4 == hybrid.responses  # linear in the request's tokens
    limit = sizing.parse_quantity(container(render(with_outputs(INGEST, ["dense", "colbert"])))
                                  ["resources"]["limits"]["memory"])
    assert limit >= hybrid.total * M.HEADROOM
    gpu = copy.deepcopy(MIG)
    gpu["model"]["outputs"] = ["dense", "colbert"]
    assert R.sizing_of(parsed(gpu)).replica.responses == 0


def test_an_embedders_embed_all_answers_are_counted_from_revision_6():
    """Issue 53: an embedder answers /embed_all, every token's state (tokens x width floats, then their JSON). The
    server holds at most sizing.RESPONSES_IN_FLIGHT answers of every token's state at once (--max-token-answers),
    of at most EMBED_ALL_TOKENS tokens each (--max-embed-all-tokens; no more than a request can carry): from
    revision 6 the estimate counts them, the larger of them and ColBERT's. A reranker, a SPLADE model and a GPU's
    slice add nothing; a Deployment at revision 5 keeps the limit its pods were given. The server's defaults are
    the estimate's."""
    from embedops_server.settings import Settings

    bge = {"model": {"id": "BAAI/bge-m3", "maxInputLength": 512}, "accelerator": {"cpu": {"cores": 4}},
           "batching": {"maxBatchTokens": 8192}}
    new, old = R.sizing_of(parsed(bge)).replica, R.sizing_of(parsed(bge), 5).replica
    per_answer = sizing.EMBED_ALL_TOKENS * 1024 * 4 * sizing.EMBED_ALL_BYTES_PER_OUTPUT_BYTE
    assert new.responses == int(sizing.RESPONSES_IN_FLIGHT * per_answer) and old.responses == 0
    assert new.total - old.total == new.responses  # float32: serving is the peak
    assert M.cpu_memory(parsed(bge), R.sizing_of(parsed(bge))) == "3840Mi"
    assert M.cpu_memory(parsed(bge), R.sizing_of(parsed(bge), 5)) == "3584Mi"
    # a request cannot carry more than maxClientBatchSize x the longest input
    few = copy.deepcopy(bge)
    few["batching"]["maxClientBatchSize"] = 4
    assert R.sizing_of(parsed(few)).replica.responses * 4 == new.responses  # 4 x 512 = 2048 tokens, not 8192
    # ColBERT's answers, when larger, are the ones counted (not both: the server holds two answers of either kind)
    colbert = copy.deepcopy(bge)
    colbert["model"]["outputs"], colbert["batching"]["maxClientBatchSize"] = ["dense", "colbert"], 64
    both = R.sizing_of(parsed(colbert)).replica
    assert both.responses == int(sizing.RESPONSES_IN_FLIGHT * 64 * 512 * 1024 * 4 * sizing.RESPONSE_BYTES_PER_OUTPUT_BYTE)
    for other in ({"id": "cross-encoder/ms-marco-MiniLM-L-6-v2"},
                  {"id": "sentence-transformers/all-MiniLM-L6-v2", "task": "sparse"}):
        spec = {**copy.deepcopy(bge), "model": {**other, "maxInputLength": 256}}
        assert R.sizing_of(parsed(spec)).replica.responses == 0, other
    assert R.sizing_of(parsed(MIG)).replica.responses == 0
    settings = Settings()
    assert (settings.max_embed_all_tokens, settings.max_token_answers) == (sizing.EMBED_ALL_TOKENS,
                                                                          sizing.RESPONSES_IN_FLIGHT)


def test_quantities_are_written_as_the_api_server_stores_them():
    """A limit of 2048Mi comes back from the API server as 2Gi: the status (and a diff against the live pod)
    would disagree with the pod. Whole Gi and Ti are written that way; the rest in Mi, rounded up."""
    assert sizing.quantity(2 * 2 ** 30) == "2Gi" and sizing.quantity(1792 * 2 ** 20) == "1792Mi"
    assert sizing.quantity(3 * 2 ** 40) == "3Ti" and sizing.quantity(2 ** 30 + 1) == "1025Mi"
    for n in (1, 2 ** 20, 1536 * 2 ** 20, 2 ** 31, 10 ** 9):
        assert n <= sizing.parse_quantity(sizing.quantity(n)) < n + 2 ** 20


def test_the_estimate_counts_the_tokenizers_the_server_holds_and_int8s_loading_peak_from_revision_4():
    """Revision 4 (render.TEMPLATE_REVISIONS): the server holds one tokenizer per worker plus one the event loop
    and the synchronous uses share, and bge-m3 is given one worker whatever its cores; int8's loading peak (the
    weights' packed copies, about half the weights above them: docs/server.md#memory) is counted. A service whose
    Deployment keeps an older revision keeps the limit its pods were given, and its status says that limit."""
    spec = parsed(INGEST)  # 4 cores
    new, old = R.sizing_of(spec, 5).replica, R.sizing_of(spec, 3).replica  # (revision 6 adds /embed_all's answers)
    per_tokenizer = sizing.TOKENIZER_BASE + sizing.TOKENIZER_BYTES_PER_PIECE * 250002
    env = {e["name"]: e.get("value") for e in container(render(INGEST))["env"]}
    assert env["TOKENIZATION_WORKERS"] == "1"
    assert new.tokenizers == 2 * per_tokenizer and old.tokenizers == 4 * per_tokenizer
    assert new.loading == int(new.weights * sizing.INT8_LOAD_PEAK) and old.loading == 0
    assert "loading" in new.describe() and "loading" not in old.describe()
    # the seed's example: dense, sparse and ColBERT answers of up to 64 inputs, 4 cores
    seed = copy.deepcopy(INGEST)
    seed["model"]["outputs"], seed["batching"]["maxClientBatchSize"] = ["dense", "sparse", "colbert"], 64
    assert M.cpu_memory(parsed(seed), R.sizing_of(parsed(seed))) == "2Gi"
    assert M.cpu_memory(parsed(seed), R.sizing_of(parsed(seed), 3)) == "2304Mi"
    fp32 = copy.deepcopy(INGEST)
    del fp32["model"]["quantize"]
    assert R.sizing_of(parsed(fp32)).replica.loading == 0  # float32: no packed int8 copies counted

    kept = ST.Observed(deployment=deployment(), pod_templates={"server": (R.Pin(revision=3), "kept")})
    assert ST.compute(defaulted(es(seed)), kept, R.Options(), now=NOW)["memory"]["limit"] == "2304Mi"
    assert ST.compute(defaulted(es(seed)), ST.Observed(deployment=deployment()), R.Options(),
                      now=NOW)["memory"]["limit"] == "2Gi"


def test_an_oom_kill_the_container_recovered_from_is_reported_not_stalled():
    """Health is now (issue 52): a running, ready container whose last termination was an OOM kill made the service
    Stalled until it died again, and under podUpgrades: Roll its upgrade slot was never freed."""
    server = {"name": "server", "restartCount": 1, "state": {"running": {"startedAt": "2026-01-01T11:40:00Z"}},
              "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137,
                                           "finishedAt": "2026-01-01T11:39:58Z"}}}
    res = defaulted(es(INGEST))
    obs = ST.Observed(deployment=deployment(replicas=1, ready=1, updated=1), pods=[_pod("p", server=server)])
    st = ST.compute(res, obs, R.Options(), now=NOW)
    assert conds(st)["Ready"] == ("True", "Available") and conds(st)["Stalled"][0] == "False"
    assert st["lastFailure"] == ("container server of pod p ended OOMKilled (exit 137) at 2026-01-01T11:39:58Z and "
                                 "runs again (1 restarts)")
    # the same container dead now: stalled, as before
    server["state"] = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    obs.pods = [_pod("p", ready=False, server=server)]
    assert conds(ST.compute(res, obs, R.Options(), now=NOW))["Stalled"] == ("True", "OOMKilled")


def test_a_container_the_kubelet_restarts_after_a_long_run_is_progress_until_it_stays_down():
    """Seen on the real node (tests/e2e/test_real_pods.py): one replica of two OOM-killed after serving made the
    service Stalled (kstatus: Failed) for the 21 s the kubelet's back-off and the restart took. A container that ran
    stallAfterSeconds or longer before it ended is restarting, not failing, until it has been down that long; one
    that fails soon after it starts (a model too large for the limit) stalls at once, as before."""
    def at(seconds_ago):
        return (NOW - dt.timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")

    def killed(ran, ago):
        return {"name": "server", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137, "startedAt": at(ago + ran),
                                             "finishedAt": at(ago)}}}
    res = defaulted(es(INGEST))
    obs = ST.Observed(deployment=deployment(replicas=2, ready=1, updated=2),
                      pods=[_pod("a"), _pod("b", ready=False, server=killed(ran=600, ago=12))])
    st = ST.compute(res, obs, R.Options(), now=NOW, stall_after=60)
    assert conds(st)["Stalled"][0] == "False" and conds(st)["Reconciling"] == ("True", "WaitingForReplicas")
    assert ST.stall_check_in(obs.pods, NOW, 60) == 48  # when it would have been down for stall_after
    # down that long: a failure
    obs.pods[1] = _pod("b", ready=False, server=killed(ran=600, ago=61))
    assert conds(ST.compute(res, obs, R.Options(), now=NOW, stall_after=60))["Stalled"] == ("True", "OOMKilled")
    assert ST.stall_check_in(obs.pods, NOW, 60) is None
    # killed 20 s after it started: it cannot hold the model, a failure at once
    obs.pods[1] = _pod("b", ready=False, server=killed(ran=20, ago=2))
    assert conds(ST.compute(res, obs, R.Options(), now=NOW, stall_after=60))["Stalled"] == ("True", "OOMKilled")
    # terminated now (before the back-off's waiting state), after a long run: restarting
    server = killed(ran=600, ago=1)
    server["state"] = {"terminated": server.pop("lastState")["terminated"]}
    obs.pods[1] = _pod("b", ready=False, server=server)
    assert conds(ST.compute(res, obs, R.Options(), now=NOW, stall_after=60))["Stalled"][0] == "False"
    # an init container that completed after a long prepare is no restart to wait for
    done = {"name": "prepare", "state": {"terminated": {"reason": "Completed", "exitCode": 0,
                                                       "startedAt": at(700), "finishedAt": at(5)}}}
    assert ST.stall_check_in([_pod("c", init=done)], NOW, 60) is None
