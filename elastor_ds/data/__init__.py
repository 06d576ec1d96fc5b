"""Training data: a built-in corpus, a download-free tokenizer, and an overlapped, resumable loader."""
from .corpus import write_synthetic_corpus
from .dataset import RecordDataset, replica_sample_indices
from .loader import PrefetchLoader
from .tokenizer import CharTokenizer

__all__ = ["write_synthetic_corpus", "RecordDataset", "replica_sample_indices", "PrefetchLoader", "CharTokenizer"]
