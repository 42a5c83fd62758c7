"""kvx's three optional native extensions; everything else is in pyproject.toml. Declared here
because setuptools calls `[tool.setuptools.ext-modules]` experimental and warns on every build.

All are optional: without a C compiler kvx still installs, kvx.layouts warns and uses its
PyTorch path (tests/layouts fail, so CI cannot miss a broken build), the storage
connector's file IO and checksum take two passes instead of one, and the per-block digests of
P/D transfers (`verify_transfers`) are computed through the `xxhash` package, one Python call
per block region.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # the layout transforms' native CPU kernel
        Extension(
            "kvx.layouts._native",
            sources=["layouts/_native.c", "layouts/_native_walk.c", "layouts/_native_pool.c"],
            depends=["layouts/_native.h"],
            optional=True,
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
        ),
        # the storage connector's one-pass file IO + checksum, built against the vendored
        # xxhash.h (vendor/xxhash/, beside core and plugins: both build against it)
        Extension(
            "kvx.plugins.storage._fileio",
            sources=[
                "plugins/storage/_fileio.c",
                "plugins/storage/_fileread.c",
                "plugins/storage/_filewrite.c",
                "plugins/storage/_fileio_avx2.c",
                "plugins/storage/_segment.c",
            ],
            depends=["plugins/storage/_fileio.h", "vendor/xxhash/xxhash.h"],
            include_dirs=["vendor/xxhash"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        # per-block XXH3 digests of KV blocks in place (kvx.contract.integrity), the same
        # vendored xxhash.h
        Extension(
            "kvx.contract._digest",
            sources=[
                "kvx/contract/_digest.c",
                "kvx/contract/_digest_avx2.c",
                "kvx/contract/_digest_avx512.c",
            ],
            depends=["kvx/contract/_digest.h", "vendor/xxhash/xxhash.h"],
            include_dirs=["vendor/xxhash"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
    ]
)
