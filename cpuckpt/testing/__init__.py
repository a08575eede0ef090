"""Test machinery shipped with the package (like ``torch.testing``): fault injection through public seams.

Nothing here is active until a test calls an ``install`` function; the product never imports it.
"""
