"""The models tilecast serves, apart from the serving machinery around them (``tilecast.runtime``).

- ``k6sr``: Kandinsky 6 video super-resolution, tilecast's own stages with sequence-parallel DiT
  and parallel tiled VAE decode.
- ``families``: the text-to-image / text-to-video families served through diffusers' pipeline
  classes (FLUX.1-dev, Qwen-Image, Z-Image-Turbo, Wan2.1 T2V).

Each is a ``tilecast.runtime.pipeline.Pipeline`` subclass that ``tilecast.runtime.registry`` names.
"""
