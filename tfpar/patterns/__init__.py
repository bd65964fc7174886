"""Sharding patterns of split TaskGraphs (Whale §3.2.2): dense, embedding,
softmax cross-entropy, argmax, contractions, mixture of experts; the matcher."""
