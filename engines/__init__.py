"""Engine adapters: one per runtime, speaking superfluid's small Engine protocol.

`engines.registry` maps runtime ids to adapters; each adapter lives in its own package
(`engines.llamacpp`, ...) and uses `kvpool` only for its types.
"""

# superfluid checks this before it uses the package: "engines" is a common name, and another
# distribution's package of that name earlier on sys.path would otherwise fail far from the cause.
PART_OF = "superfluid"
