HOPPER_CONFIGS: dict[int, MoeConfig] = {
    352: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(256, 64, 8, 4)),  # from 256 tokens
    720: MoeConfig(128, Tiles(256, 64, 8, 4), Tiles(128, 128, 8, 3)),  # from 512 tokens
    1024: MoeConfig(128, Tiles(256, 64, 8, 3), Tiles(256, 64, 8, 4)),  # from 1024 tokens
}
