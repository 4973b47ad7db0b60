"""Inference backends (torch, ONNX Runtime). They take padded numpy batches and return numpy outputs."""
