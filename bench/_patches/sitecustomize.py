"""Experiment hook for bench variants (never used by the server itself): started with this folder first on
PYTHONPATH, an embedops server's ONNX Runtime sessions get the settings named in EMBEDOPS_BENCH_ORT
(comma list: ``nospin`` = session.intra_op.allow_spinning 0, ``dynblock`` = session.intra_op.dynamic_block_base 4,
``stopspin`` = session.force_spinning_stop 1). Lets the bench measure a proposed server
change side by side without editing server code."""
import os

_opts = set(filter(None, os.environ.get("EMBEDOPS_BENCH_ORT", "").split(",")))
if _opts:
    try:
        import onnxruntime as _ort

        _orig = _ort.InferenceSession.__init__

        def _init(self, path_or_bytes, sess_options=None, *a, **kw):
            so = sess_options or _ort.SessionOptions()
            if "nospin" in _opts:
                so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            if "stopspin" in _opts:  # spinning pool threads stop as soon as Run returns
                so.add_session_config_entry("session.force_spinning_stop", "1")
            if "dynblock" in _opts:
                so.add_session_config_entry("session.intra_op.dynamic_block_base", "4")
            return _orig(self, path_or_bytes, so, *a, **kw)

        _ort.InferenceSession.__init__ = _init
    except Exception:  # the experiment must never break a server start
        pass
