"""A tiny model of every backbone class KerasHub exports, built from a config.

`BACKBONES[name]()` builds `keras_hub.models.<name>` without downloading
anything: vocabulary 64, one or two layers, widths of 8 to 32, 4 (or 8)
attention heads so that a "model" axis of size 4 divides them, images of 16
to 126 pixels (the smallest some backbones' downsampling allows). `ABSTRACT`
names the exported base classes, which have no layers of their own.
"""

from __future__ import annotations

from typing import Any, Callable

VOCABULARY = 64
TEXT = dict(vocabulary_size=VOCABULARY, num_layers=1, hidden_dim=16, intermediate_dim=32)
GROUPED = dict(TEXT, num_query_heads=8, num_key_value_heads=4)
# Qwen 3.5: a linear-attention layer and a full-attention one, rotating half
# of each head (a quarter of 4 features is not even).
QWEN3_5_LAYERS = dict(
    layer_types=["linear_attention", "full_attention"], partial_rotary_factor=0.5,
    linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=4,
    linear_value_head_dim=4,
)
IMAGE = (32, 32, 3)
SMALL_IMAGE = (16, 16, 3)

ABSTRACT = {
    "Backbone": "base class of every backbone",
    "FeaturePyramidBackbone": "base class of the vision backbones",
}


def _models() -> Any:
    import keras_hub  # imported on use: only the KerasHub tests need it

    return keras_hub.models


def _config(name: str, **kwargs: Any) -> Callable[[], Any]:
    return lambda: getattr(_models(), name)(**kwargs)


def _gemma3n() -> Any:
    return _models().Gemma3nBackbone(
        text_vocab_size=VOCABULARY, text_hidden_size=16, num_hidden_layers=1, pad_token_id=0,
        num_attention_heads=4, num_key_value_heads=4, head_dim=4, intermediate_size=[32],
        hidden_activation="gelu_approximate", layer_types=["full_attention"], sliding_window=4,
        rope_theta=10000.0, max_position_embeddings=16, vocab_size_per_layer_input=VOCABULARY,
        hidden_size_per_layer_input=4, altup_num_inputs=2, laurel_rank=4,
    )


def _encoder_decoder_gemma(name: str) -> Callable[[], Any]:
    sizes = dict(hidden_dim=16, intermediate_dim=32, num_layers=1, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=4, layer_types=["full_attention"])
    per_side = {
        f"{side}_{key}": value for side in ("encoder", "decoder") for key, value in sizes.items()
    }
    return _config(name, vocabulary_size=VOCABULARY, dropout_rate=0.0, **per_side)


def _smollm(name: str) -> Callable[[], Any]:
    return _config(
        name, vocabulary_size=VOCABULARY, hidden_dim=16, intermediate_dim=32, num_layers=1,
        num_attention_heads=8, num_key_value_heads=4, attention_bias=False, attention_dropout=0.0,
        rope_layer_enabled_list=[True], layer_types=["attention"], mlp_bias=False,
        layer_norm_epsilon=1e-5, max_position_embeddings=16, rope_theta=10000.0,
        partial_rotary_factor=1.0,
    )


def _resnet(**kwargs: Any) -> Any:
    # ResNet's first stage must have 64 filters, as many as its stem.
    return _models().ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 32, 32, 32], stackwise_num_blocks=[1, 1, 1, 1],
        stackwise_num_strides=[1, 2, 2, 2], block_type="basic_block", **kwargs,
    )


def _bottleneck_resnet() -> Any:
    """BASNet feeds its first convolution's `projection_filters` channels to
    the ResNet's first stage: a bottleneck stage (a convolution on its
    shortcut) takes any number."""
    return _models().ResNetBackbone(
        input_conv_filters=[8], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 8, 8, 8],
        stackwise_num_blocks=[1, 1, 1, 1], stackwise_num_strides=[1, 2, 2, 2],
        block_type="bottleneck_block",
    )


def _mit() -> Any:
    return _models().MiTBackbone(
        layerwise_depths=[1, 1], image_shape=IMAGE, hidden_dims=[8, 16], num_layers=2,
        layerwise_num_heads=[2, 4], layerwise_sr_ratios=[4, 2], max_drop_path_rate=0.0,
        layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2],
    )


def _dinov2(image_shape: tuple[int, ...] = (28, 28, 3), num_layers: int = 1, **kwargs: Any) -> Any:
    return _models().DINOV2Backbone(
        patch_size=14, num_layers=num_layers, hidden_dim=16, num_heads=4, intermediate_dim=32,
        image_shape=image_shape, position_embedding_shape=image_shape, **kwargs,
    )


def _vit(image_shape: tuple[int, ...] = SMALL_IMAGE, patch_size: Any = 4, **kwargs: Any) -> Any:
    return _models().ViTBackbone(
        image_shape=image_shape, patch_size=patch_size, num_layers=1, num_heads=4, hidden_dim=16,
        mlp_dim=32, **kwargs,
    )


def _vitdet() -> Any:
    return _models().ViTDetBackbone(
        hidden_size=16, num_layers=2, intermediate_dim=32, num_heads=4,
        global_attention_layer_indices=[1], image_shape=IMAGE, patch_size=8,
        num_output_channels=8, window_size=2,
    )


def _mobilenet() -> Any:
    return _models().MobileNetBackbone(
        stackwise_expansion=[[16], [32]], stackwise_num_blocks=[1, 1],
        stackwise_num_filters=[[8], [16]], stackwise_kernel_size=[[3], [3]],
        stackwise_num_strides=[[2], [2]], stackwise_se_ratio=[[None], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"]], stackwise_padding=[[1], [1]],
        output_num_filters=32, depthwise_filters=8, depthwise_stride=1, depthwise_residual=False,
        last_layer_filter=32, squeeze_and_excite=0.5, image_shape=IMAGE, input_num_filters=8,
    )


def _mobilenetv5() -> Any:
    per_block = dict(
        block_types=[["er"], ["uir", "uir"]], num_filters=[[16], [32, 32]], strides=[[2], [2, 1]],
        act_layers=[["relu"], ["relu", "relu"]], exp_ratios=[[2.0], [2.0, 2.0]],
        se_ratios=[[0.0], [0.0, 0.0]], dw_kernel_sizes=[[0], [3, 3]],
        dw_start_kernel_sizes=[[0], [0, 0]], dw_end_kernel_sizes=[[0], [0, 0]],
        exp_kernel_sizes=[[3], [0, 0]], pw_kernel_sizes=[[1], [0, 0]], num_heads=[[0], [0, 0]],
        key_dims=[[0], [0, 0]], value_dims=[[0], [0, 0]], kv_strides=[[0], [0, 0]],
        use_cpe=[[False], [False, False]],
    )
    return _models().MobileNetV5Backbone(
        stackwise_num_blocks=[1, 2], image_shape=IMAGE, stem_size=8, use_msfa=False,
        num_features=32, **{f"stackwise_{key}": value for key, value in per_block.items()},
    )


def _hgnetv2(**overrides: Any) -> Any:
    config = dict(
        depths=[1, 1], embedding_size=8, hidden_sizes=[16, 32], stem_channels=[3, 8, 8],
        hidden_act="relu", use_learnable_affine_block=False,
        stackwise_stage_filters=[(8, 8, 16, 1, 1, 3), (16, 8, 32, 1, 1, 3)],
        apply_downsample=[False, True], use_lightweight_conv_block=[False, True], image_shape=IMAGE,
    )
    return _models().HGNetV2Backbone(**{**config, **overrides})


def _dfine() -> Any:
    stages = [[8, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3], [32, 8, 32, 1, 1, 3], [32, 8, 32, 1, 1, 3]]
    hgnet = _hgnetv2(
        depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 32, 32], stackwise_stage_filters=stages,
        apply_downsample=[False, True, True, True],
        use_lightweight_conv_block=[False, False, True, True], use_learnable_affine_block=True,
        image_shape=(None, None, 3), out_features=["stage3", "stage4"],
    )
    return _models().DFineBackbone(
        backbone=hgnet, decoder_in_channels=[16, 16], encoder_hidden_dim=16, num_denoising=0,
        num_labels=4, hidden_dim=16, learn_initial_query=False, num_queries=8,
        anchor_image_size=(64, 64), feat_strides=[16, 32], num_feature_levels=2,
        encoder_in_channels=[32, 32], encode_proj_layers=[1], num_attention_heads=4,
        encoder_ffn_dim=32, num_encoder_layers=1, hidden_expansion=0.5, depth_multiplier=0.5,
        eval_idx=-1, num_decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=32,
        decoder_n_points=[2, 2], lqe_hidden_dim=8, num_lqe_layers=2,
        out_features=["stage3", "stage4"], image_shape=(64, 64, 3), seed=0,
    )


def _two_towers(prefix: str) -> Callable[[], Any]:
    """CLIP, MetaCLIP 2 and SigLIP: a vision and a text encoder."""

    def build() -> Any:
        models = _models()
        vision = getattr(models, f"{prefix}VisionEncoder")(
            patch_size=4, hidden_dim=16, num_layers=1, num_heads=4, intermediate_dim=32,
            image_shape=SMALL_IMAGE,
        )
        text = getattr(models, f"{prefix}TextEncoder")(
            vocabulary_size=VOCABULARY, embedding_dim=16, hidden_dim=16, num_layers=1, num_heads=4,
            intermediate_dim=32, max_sequence_length=8,
        )
        projection = {} if prefix == "SigLIP" else {"projection_dim": 16}
        backbone = getattr(models, f"{prefix}Backbone")
        return backbone(vision_encoder=vision, text_encoder=text, **projection)

    return build


def _blip2() -> Any:
    from keras_hub.src.models.blip2.blip2_custom_opt import BLIP2CustomOPT
    from keras_hub.src.models.blip2.blip2_qformer import BLIP2QFormer

    models = _models()
    vision = models.BLIP2VisionEncoder(
        image_size=16, patch_size=4, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
        use_patch_bias=True, use_class_token=True, use_mha_bias=True, use_mlp_bias=True,
        dropout_rate=0.0, layer_norm_epsilon=1e-6, initializer_range=0.02,
    )
    qformer = BLIP2QFormer(
        num_query_tokens=4, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
        vision_dim=16, cross_attention_frequency=1, dropout=0.0, layer_norm_epsilon=1e-6,
    )
    language = BLIP2CustomOPT(
        vocabulary_size=VOCABULARY, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
        num_query_tokens=4, dropout=0.0, max_sequence_length=16, qformer_hidden_dim=16,
    )
    return models.BLIP2Backbone(vision_encoder=vision, qformer=qformer, language_model=language)


def _sam() -> Any:
    from keras_hub.src.models.sam.sam_mask_decoder import SAMMaskDecoder
    from keras_hub.src.models.sam.sam_prompt_encoder import SAMPromptEncoder

    return _models().SAMBackbone(
        image_encoder=_vitdet(),
        prompt_encoder=SAMPromptEncoder(
            hidden_size=8, image_embedding_size=(4, 4), input_image_size=(32, 32),
            mask_in_channels=16,
        ),
        mask_decoder=SAMMaskDecoder(
            num_layers=1, hidden_size=8, intermediate_dim=32, num_heads=4, embedding_dim=8,
            num_multimask_outputs=3, iou_head_depth=2, iou_head_hidden_dim=8,
        ),
    )


def _sam3() -> Any:
    from keras_hub.src.models.sam3 import (
        sam3_detr_decoder,
        sam3_detr_encoder,
        sam3_geometry_encoder,
        sam3_mask_decoder,
        sam3_text_encoder,
        sam3_vision_encoder,
    )

    image, sizes = (28, 28, 3), dict(hidden_dim=16, intermediate_dim=32, num_heads=4)
    return _models().SAM3PromptableConceptBackbone(
        vision_encoder=sam3_vision_encoder.SAM3VisionEncoder(
            image_shape=image, patch_size=14, num_layers=1, fpn_hidden_dim=16,
            fpn_scale_factors=[4.0, 2.0, 1.0, 0.5], pretrain_image_shape=image, window_size=0,
            global_attn_indexes=[0], **sizes,
        ),
        text_encoder=sam3_text_encoder.SAM3TextEncoder(
            vocabulary_size=VOCABULARY, embedding_dim=16, num_layers=1, **sizes
        ),
        geometry_encoder=sam3_geometry_encoder.SAM3GeometryEncoder(
            num_layers=1, roi_size=2, **sizes
        ),
        detr_encoder=sam3_detr_encoder.SAM3DetrEncoder(num_layers=1, **sizes),
        detr_decoder=sam3_detr_decoder.SAM3DetrDecoder(
            image_shape=image, patch_size=14, num_layers=1, num_queries=4, **sizes
        ),
        mask_decoder=sam3_mask_decoder.SAM3MaskDecoder(
            num_upsampling_stages=2, hidden_dim=16, num_heads=4
        ),
    )


def _stable_diffusion_3() -> Any:
    from keras_hub.src.models.vae.vae_backbone import VAEBackbone

    models = _models()
    # The VAE's group normalizations have 32 groups: 32 channels at least.
    vae = VAEBackbone([32, 32], [1, 1], [32, 32], [1, 1], sampler_method="mode", sample_channels=16)
    # The intermediate output (-2) needs two layers.
    clip_l = models.CLIPTextEncoder(VOCABULARY, 16, 16, 2, 4, 32, "quick_gelu", -2, name="clip_l")
    clip_g = models.CLIPTextEncoder(VOCABULARY, 16, 16, 2, 4, 32, "gelu", -2, name="clip_g")
    return models.StableDiffusion3Backbone(
        mmdit_patch_size=2, mmdit_hidden_dim=16, mmdit_num_layers=1, mmdit_num_heads=4,
        mmdit_position_size=16, mmdit_qk_norm=None, mmdit_dual_attention_indices=None, vae=vae,
        clip_l=clip_l, clip_g=clip_g, image_shape=SMALL_IMAGE,
    )


def _efficientnet() -> Any:
    per_stack = dict(
        kernel_sizes=[3, 3], num_repeats=[1, 1], input_filters=[8, 8], output_filters=[8, 16],
        expansion_ratios=[1, 4], squeeze_and_excite_ratios=[0.0, 0.25], strides=[1, 2],
        block_types=["fused", "unfused"], force_input_filters=[0, 0], nores_option=[False, False],
        width_coefficients=[1.0, 1.0], depth_coefficients=[1.0, 1.0],
    )
    return _models().EfficientNetBackbone(
        input_shape=IMAGE, num_features=32, dropout=0.0,
        **{f"stackwise_{key}": value for key, value in per_stack.items()},
    )


BACKBONES: dict[str, Callable[[], Any]] = {
    # Text.
    "AlbertBackbone": _config(
        "AlbertBackbone", **TEXT, num_heads=4, embedding_dim=8, max_sequence_length=16
    ),
    "BartBackbone": _config("BartBackbone", **TEXT, num_heads=4, max_sequence_length=16),
    "BertBackbone": _config("BertBackbone", **TEXT, num_heads=4, max_sequence_length=16),
    "BloomBackbone": _config("BloomBackbone", **TEXT, num_heads=4),
    "DebertaV3Backbone": _config(
        "DebertaV3Backbone", **TEXT, num_heads=4, max_sequence_length=16, bucket_size=4
    ),
    "DistilBertBackbone": _config(
        "DistilBertBackbone", **TEXT, num_heads=4, max_sequence_length=16
    ),
    "ESM2Backbone": _config("ESM2Backbone", **TEXT, num_heads=4, max_sequence_length=16),
    "ESMBackbone": _config("ESMBackbone", **TEXT, num_heads=4, max_sequence_length=16),
    "EdRecBackbone": _config(
        "EdRecBackbone", vocab_size=VOCABULARY, num_layers_enc=1, num_layers_dec=1, hidden_dim=16,
        intermediate_dim=32, num_heads=4,
    ),
    "ElectraBackbone": _config(
        "ElectraBackbone", vocab_size=VOCABULARY, num_layers=1, hidden_dim=16, intermediate_dim=32,
        num_heads=4, embedding_dim=16, max_sequence_length=16,
    ),
    "FNetBackbone": _config("FNetBackbone", **TEXT, max_sequence_length=16),
    "FalconBackbone": _config("FalconBackbone", **TEXT, num_attention_heads=4),
    "GPT2Backbone": _config("GPT2Backbone", **TEXT, num_heads=4, max_sequence_length=16),
    # Rotary embeddings rotate an even number of features: half of 4, not a quarter.
    "GPTNeoXBackbone": _config(
        "GPTNeoXBackbone", **TEXT, num_heads=4, max_sequence_length=16, rotary_percentage=0.5
    ),
    "Gemma3Backbone": _config("Gemma3Backbone", **GROUPED, head_dim=4, image_size=16),
    "Gemma3nBackbone": _gemma3n,
    "Gemma4Backbone": _config(
        "Gemma4Backbone", **GROUPED, head_dim=4, image_size=16, sliding_window_size=8
    ),
    "GemmaBackbone": _config("GemmaBackbone", **GROUPED, head_dim=4),
    "GptOssBackbone": _config(
        "GptOssBackbone", **GROUPED, num_experts=4, top_k=2, head_dim=4, sliding_window=8
    ),
    "Llama3Backbone": _config("Llama3Backbone", **GROUPED),
    "LlamaBackbone": _config("LlamaBackbone", **GROUPED),
    "MistralBackbone": _config("MistralBackbone", **GROUPED),
    "MixtralBackbone": _config("MixtralBackbone", **GROUPED, num_experts=4, top_k=2),
    "MoonshineBackbone": _config(
        "MoonshineBackbone", vocabulary_size=VOCABULARY, filter_dim=16, encoder_num_layers=1,
        decoder_num_layers=1, hidden_dim=16, intermediate_dim=32, encoder_num_heads=4,
        decoder_num_heads=4,
    ),
    "OPTBackbone": _config("OPTBackbone", **TEXT, num_heads=4, max_sequence_length=16),
    "Phi3Backbone": _config("Phi3Backbone", **GROUPED),
    "Qwen2Backbone": _config("Qwen2Backbone", **GROUPED),
    "Qwen3Backbone": _config("Qwen3Backbone", **GROUPED, head_dim=4),
    "Qwen3MoeBackbone": _config(
        "Qwen3MoeBackbone", **GROUPED, moe_intermediate_dim=16, num_experts=4, top_k=2, head_dim=4
    ),
    "Qwen3_5Backbone": _config(
        "Qwen3_5Backbone", **dict(GROUPED, num_layers=2), head_dim=4, **QWEN3_5_LAYERS,
    ),
    "Qwen3_5MoeBackbone": _config(
        "Qwen3_5MoeBackbone", vocabulary_size=VOCABULARY, num_layers=2, hidden_dim=16,
        num_query_heads=8, num_key_value_heads=4, head_dim=4, moe_intermediate_dim=16,
        shared_expert_intermediate_size=32, num_experts=4, top_k=2, **QWEN3_5_LAYERS,
    ),
    "QwenBackbone": _config("QwenBackbone", **GROUPED),
    "QwenMoeBackbone": _config(
        "QwenMoeBackbone", **GROUPED, moe_intermediate_dim=16, shared_expert_intermediate_dim=32,
        num_experts=4, top_k=2,
    ),
    "RWKV7Backbone": _config(
        "RWKV7Backbone", hidden_size=16, head_size=4, num_layers=1, vocabulary_size=VOCABULARY,
        intermediate_dim=32, gate_lora=8, mv_lora=8, aaa_lora=8, decay_lora=8,
    ),
    "RobertaBackbone": _config("RobertaBackbone", **TEXT, num_heads=4, max_sequence_length=16),
    "RoformerV2Backbone": _config("RoformerV2Backbone", **TEXT, num_heads=4, head_size=4),
    "SmolLM3Backbone": _smollm("SmolLM3Backbone"),
    "SmolLMBackbone": _smollm("SmolLMBackbone"),
    "T5Backbone": _config("T5Backbone", **TEXT, num_heads=4),
    "T5Gemma2Backbone": _encoder_decoder_gemma("T5Gemma2Backbone"),
    "T5GemmaBackbone": _encoder_decoder_gemma("T5GemmaBackbone"),
    "WhisperBackbone": _config(
        "WhisperBackbone", **TEXT, num_heads=4, num_mels=8, max_encoder_sequence_length=16,
        max_decoder_sequence_length=16,
    ),
    "XLMRobertaBackbone": _config(
        "XLMRobertaBackbone", **TEXT, num_heads=4, max_sequence_length=16
    ),
    "XLNetBackbone": _config("XLNetBackbone", **TEXT, num_heads=4),
    # Images and video.
    "CSPNetBackbone": _config(
        "CSPNetBackbone", stem_filters=8, stem_kernel_size=3, stem_strides=1, stackwise_strides=2,
        stackwise_depth=[1, 1], stackwise_num_filters=[8, 16], image_shape=IMAGE, down_growth=True,
        bottle_ratio=(0.5, 1.0), block_ratio=(1.0, 0.5), expand_ratio=(2.0, 1.0),
        block_type="dark_block", stage_type="csp", stem_padding="same",
    ),
    "DINOV2Backbone": _dinov2,
    "DINOV3Backbone": _config(
        "DINOV3Backbone", patch_size=8, num_layers=1, hidden_dim=16, num_heads=4,
        intermediate_dim=32, num_register_tokens=4, image_shape=SMALL_IMAGE,
    ),
    "DeiTBackbone": _config(
        "DeiTBackbone", image_shape=SMALL_IMAGE, patch_size=4, num_layers=1, num_heads=4,
        hidden_dim=16, intermediate_dim=32,
    ),
    "DenseNetBackbone": _config(
        "DenseNetBackbone", stackwise_num_repeats=[1, 1], image_shape=IMAGE, growth_rate=8
    ),
    "EfficientNetBackbone": _efficientnet,
    "HGNetV2Backbone": _hgnetv2,
    "MiTBackbone": _mit,
    "MobileNetBackbone": _mobilenet,
    "MobileNetV5Backbone": _mobilenetv5,
    "PaliGemmaBackbone": _config(
        "PaliGemmaBackbone", **GROUPED, image_size=16, head_dim=4, vit_patch_size=4,
        vit_num_heads=4, vit_hidden_dim=16, vit_intermediate_dim=32, vit_num_layers=1,
    ),
    "ResNetBackbone": lambda: _resnet(image_shape=IMAGE),
    "SwinTransformerBackbone": _config(
        "SwinTransformerBackbone", image_shape=IMAGE, embed_dim=16, depths=(1, 1), num_heads=(4, 4),
        window_size=2, patch_size=4, drop_path=0.0,
    ),
    "VGGBackbone": _config(
        "VGGBackbone", stackwise_num_repeats=[2, 2], stackwise_num_filters=[8, 16],
        image_shape=IMAGE,
    ),
    "ViTBackbone": _vit,
    "ViTDetBackbone": _vitdet,
    "VideoPrismBackbone": _config(
        "VideoPrismBackbone", num_frames=2, patch_size=4, hidden_dim=16, intermediate_dim=32,
        num_heads=4, num_spatial_layers=1, num_temporal_layers=1, num_auxiliary_layers=1,
        vocabulary_size=VOCABULARY, num_text_layers=1, image_shape=SMALL_IMAGE,
    ),
    "XceptionBackbone": _config(
        "XceptionBackbone", stackwise_conv_filters=[[8, 16], [16, 32]],
        stackwise_pooling=[True, False], image_shape=IMAGE,
    ),
    # Built around other backbones or encoders.
    "BASNetBackbone": lambda: _models().BASNetBackbone(
        image_encoder=_bottleneck_resnet(), num_classes=1, projection_filters=8,
        image_shape=(64, 64, 3),
    ),
    "BLIP2Backbone": _blip2,
    "CLIPBackbone": _two_towers("CLIP"),
    "DFineBackbone": _dfine,
    "DeepLabV3Backbone": lambda: _models().DeepLabV3Backbone(
        image_encoder=_resnet(image_shape=IMAGE), low_level_feature_key="P2",
        spatial_pyramid_pooling_key="P4", dilation_rates=[1, 2], upsampling_size=4,
        projection_filters=8, image_shape=IMAGE,
    ),
    # The neck's last reassembly halves 9 x 9 patches: 126 pixels at least.
    "DepthAnythingBackbone": lambda: _models().DepthAnythingBackbone(
        image_encoder=_dinov2(
            (126, 126, 3), num_layers=4, apply_layernorm=True, name="image_encoder"
        ),
        reassemble_factors=[4, 2, 1, 0.5], neck_hidden_dims=[8, 8, 16, 16], fusion_hidden_dim=16,
        head_hidden_dim=8, head_in_index=-1, feature_keys=["stage1", "stage2", "stage3", "stage4"],
    ),
    "FluxBackbone": _config(
        "FluxBackbone", input_channels=16, hidden_size=16, mlp_ratio=2.0, num_heads=4, depth=1,
        depth_single_blocks=1, axes_dim=[2, 2, 0], theta=10_000, use_bias=True, guidance_embed=True,
        image_shape=(8, 16), text_shape=(8, 16), image_ids_shape=(8, 3), text_ids_shape=(8, 3),
        y_shape=(16,),
    ),
    "MetaCLIP2Backbone": _two_towers("MetaCLIP2"),
    "PARSeqBackbone": lambda: _models().PARSeqBackbone(
        image_encoder=_vit((16, 32, 3), (4, 8), use_class_token=False, name="image_encoder"),
        vocabulary_size=VOCABULARY, max_label_length=8, decoder_hidden_dim=16, num_decoder_layers=1,
        num_decoder_heads=4, decoder_mlp_dim=32, dropout_rate=0.0, attention_dropout=0.0,
    ),
    "RetinaNetBackbone": lambda: _models().RetinaNetBackbone(
        image_encoder=_resnet(image_shape=IMAGE), min_level=3, max_level=5, use_p5=False,
        image_shape=IMAGE,
    ),
    "SAM3PromptableConceptBackbone": _sam3,
    "SAMBackbone": _sam,
    "SegFormerBackbone": lambda: _models().SegFormerBackbone(
        image_encoder=_mit(), projection_filters=16
    ),
    "SigLIPBackbone": _two_towers("SigLIP"),
    "StableDiffusion3Backbone": _stable_diffusion_3,
}


def pooled_classifier(name: str) -> Any:
    """The tiny backbone `name` under a mean pooling and a 4-way Dense head:
    a whole model for `pooled_classifier_data`."""
    import keras

    backbone = BACKBONES[name]()
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone.output)
    classifier = keras.layers.Dense(4, name="classifier")(pooled)
    return keras.Model(backbone.input, classifier, name=f"{name.removesuffix('Backbone').lower()}_classifier")


def pooled_classifier_data(n: int = 13, name: str = "") -> tuple[dict, Any]:
    """`n` rows of tokens with padding masks (every third row padded) and
    4 regression targets each; for Gemma 4's backbone (`name`), each
    token's position too."""
    import numpy as np
    from test_keras_interop import token_data

    x, _, _ = token_data(n=n)
    if name == "Gemma4Backbone":
        x["position_ids"] = np.broadcast_to(np.arange(x["token_ids"].shape[1], dtype="int32"), x["token_ids"].shape)
    return x, np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
