"""Pure planning and format modules: file layouts, torch.save-compatible records, the manifest, plan reuse.

No file I/O, no threads, no collectives: everything here can be unit-tested on bytes alone.
"""
