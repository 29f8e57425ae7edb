"""Everything between a recipe's corpus URLs and the binarized splits the trainer reads.

fetch      download, cache, mirror, checksum and unpack one file
corpora    turn a CorpusSpec into aligned raw text files (sacrebleu's registry for its test sets)
clean      the Moses clean-corpus-n filter on training pairs
filters    what to drop from synthetic pairs (a model's output): empty, badly sized, looping, worst
binarized  subword ids on disk: compact, memory-mapped, no pickles
batching   token-budget batches over a binarized split
loader     the update plan of a training run, and the background loader that fills it
preprocess the whole stage, `nmt preprocess`
"""
