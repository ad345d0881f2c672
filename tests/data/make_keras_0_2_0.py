"""Makes tests/data/vit_0_2_0.keras and vit_0_2_0_io.npz with keras_vit 0.2.0 (the last commit before 0.3.0's
changes, eeb2301): a model whose saved `vit_config` has 0.2.0's fields (no `resize_size`), built from the
transformers DINOv2 file of tests/data/families (registers none, layer scale, its processor's mean, std, shortest
edge and crop, transformers' bicubic position resampling) at 64 px, and its probabilities on fixed images.

    git worktree add /tmp/keras_vit_0_2_0 eeb2301
    cd /tmp/keras_vit_0_2_0 && PYTHONPATH=. python /path/to/this/file.py /path/to/repo/tests/data
"""

import os
import sys

import numpy as np

import keras_vit

out = sys.argv[1]
assert keras_vit.__version__ == "0.2.0", keras_vit.__version__
model = keras_vit.VisionTransformer(weights=os.path.join(out, "families", "hf_dinov2_224"), input_shape=(64, 64, 3),
                                   include_top=False, pooling="token", name="vit_0_2_0")
images = np.random.default_rng(0).uniform(0, 255, (2, 64, 64, 3)).astype("float32")
model.save(os.path.join(out, "vit_0_2_0.keras"))
np.savez(os.path.join(out, "vit_0_2_0_io.npz"), images=images, embeddings=model.predict(images, verbose=0))
print(model.vit_config)
