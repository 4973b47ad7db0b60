"""Engine core: model/task detection, tokenization, the token-budget queue and the inference thread.

Nothing here knows about HTTP.
"""
