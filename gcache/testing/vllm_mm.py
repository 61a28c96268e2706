"""A tiny LLaVA-style model and images for the vLLM group's multimodal tests and benches
(not used by the connectors).

`write_llava(dir, text_config)` (testing.write_model("llava", dir)) builds everything offline: a word-level tokenizer ("<unk>", "<s>", "</s>",
"<image>", then "w0".."w507"), a CLIP image processor (PIL backend: the group's venv has no
torchvision), a LlavaProcessor, a small CLIP vision tower (2 layers, 64 wide) and a small
text tower ("llama", or "mistral"/"gemma2" for sliding-window layers) with seeded random
weights. The weights are written under the names vLLM's LLaVA loads
(vision_tower.vision_model.*, language_model.model.*), not transformers 5's checkpoint names.

An image is IMAGE_SIZE pixels square: (IMAGE_SIZE / PATCH)^2 = 16 placeholder tokens and
embeddings of TEXT_WIDTH (128) floats each. `image(seed)` makes one from seeded numpy noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_TOKEN = "<image>"
SPECIAL = ["<unk>", "<s>", "</s>", IMAGE_TOKEN]
IMAGE_SIZE = 56
PATCH = 14
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
TEXT_WIDTH = 128
VOCAB = 512  # the text models' vocabulary size (testing.VOCAB)
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]

# vLLM's llava.py imports transformers' Pixtral image processor module, which needs
# torchvision; the PIL twin defines the one function vLLM takes from it. Engine processes get
# this file on PYTHONPATH (testing.engine_env), so vLLM's model-inspection subprocess has it too.
SITECUSTOMIZE = """\
import importlib.abc, importlib.util, sys

_NAME = "transformers.models.pixtral.image_processing_pixtral"


class _PixtralWithoutTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _NAME:
            return None
        sys.meta_path.remove(self)
        try:
            if importlib.util.find_spec("torchvision") is not None:
                return None
            pil = importlib.util.find_spec("transformers.models.pixtral.image_processing_pil_pixtral")
            return importlib.util.spec_from_file_location(fullname, pil.origin)
        finally:
            sys.meta_path.insert(0, self)


sys.meta_path.insert(0, _PixtralWithoutTorchvision())
"""

_RENAMES = (
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.language_model.", "language_model.model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def write_shim(where: str | Path) -> Path:
    directory = Path(where)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


def write_llava(
    where: str | Path,
    text_config: Any,  # a transformers config
    *,
    text: str = "llama",
    seed: int = 0,
    image_size: int = IMAGE_SIZE,
    vision_hidden: int = 64,
    vision_layers: int = 2,
) -> Path:
    """A tiny LLaVA model with seeded random weights (std 0.2) in `path`, over `text_config`
    (a transformers config of kind `text`, TEXT_WIDTH wide, VOCAB words: testing.write_model
    builds it); an image is (image_size / PATCH)^2 tokens (the benches use larger ones)."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    images = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=fast,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=2 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=max(2, vision_hidden // 32),
        image_size=image_size,
        patch_size=PATCH,
        projection_dim=vision_hidden,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_index=vocab[IMAGE_TOKEN],
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        projector_hidden_act="gelu",
    )
    cfg.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg)
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.05 if (text == "gemma2" and "embed_tokens" in name) else 0.2)
        for name, tensor in model.state_dict().items():
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            tensors[name] = tensor.contiguous().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)
    processor.save_pretrained(path)
    (path / "params.txt").write_text(str(sum(t.numel() for t in tensors.values())))
    return path


def image(seed: int, size: int = IMAGE_SIZE + 8) -> Image:
    """An RGB PIL image of seeded noise (resized and cropped to IMAGE_SIZE by the processor)."""
    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels)


def write_png(seed: int, where: str | Path) -> Path:
    path = Path(where)
    image(seed).save(path, format="PNG")
    return path


def text(n_words: int, seed: int = 0) -> str:
    """n_words words of the tiny vocabulary (reproducible)."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def prompt(words_before: int, words_after: int, seed: int = 0, images: int = 1) -> str:
    """Text with `images` image tokens after `words_before` words."""
    return " ".join([text(words_before, seed)] + [IMAGE_TOKEN] * images + [text(words_after, seed + 1000)])


def data_url(path: str | Path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()
