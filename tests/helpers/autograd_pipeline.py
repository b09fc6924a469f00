"""A pipeline whose call takes gradients, as Attend-and-Excite, DiffEdit and Pix2Pix-Zero
do: DDIM whose every step is nudged down the gradient of the latents' squared norm, taken
with ``torch.enable_grad()`` inside the call's own ``no_grad``.  It cannot run in inference
mode (its latents could not require grad); the integration runs it outside the worker's."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import DDIMPipeline, ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from omni_async.integrations.diffusers.tiny import tiny_family


class GradientNudgedDDIMPipeline(DDIMPipeline):  # type: ignore[misc]
    @torch.no_grad()
    def __call__(
        self,
        batch_size: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        num_inference_steps: int = 2,
        nudge: float = 0.05,
        output_type: str = "pil",
        return_dict: bool = True,
    ) -> Any:
        size = self.unet.config.sample_size
        shape = (batch_size, self.unet.config.in_channels, size, size)
        image = randn_tensor(shape, generator=generator, device=self._execution_device, dtype=self.unet.dtype)
        self.scheduler.set_timesteps(num_inference_steps)
        for t in self.progress_bar(self.scheduler.timesteps):
            model_output = self.unet(image, t).sample
            with torch.enable_grad():
                x = image.detach().requires_grad_(True)
                (grad,) = torch.autograd.grad((x * x).sum(), x)
            image = self.scheduler.step(model_output + nudge * grad, t, image).prev_sample
        image = (image / 2 + 0.5).clamp(0, 1)
        if output_type != "pt":
            image = image.cpu().permute(0, 2, 3, 1).numpy()
            if output_type == "pil":
                image = self.numpy_to_pil(image)
        return ImagePipelineOutput(images=image) if return_dict else (image,)


def gradient_nudged_ddim(seed: int = 0) -> GradientNudgedDDIMPipeline:
    """The tiny DDIM family's random components (``tiny_family("ddim")``) in this pipeline."""
    base: Any = tiny_family("ddim", seed)
    return GradientNudgedDDIMPipeline(**base.components)
