"""The public calls: attention and its backward, prepared calls, the decode plan cache, interop."""
