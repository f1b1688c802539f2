# Sourced by the GPU scripts: the carried nvidia-cudnn-frontend wheel (CUDNN_WHEELS, default
# .whl/cudnn_fe: scripts/cudnn_wheels.sh builds it) installed into a side directory (nothing
# downloaded) and appended to PYTHONPATH, so the engine's default prefill (cuDNN's paged
# attention where the frontend imports) is what runs; CUDNN_FE=0 skips it. Prints the frontend's
# and cuDNN's versions (or that it did not import).
cudnn_path() {
  local cw=${CUDNN_WHEELS:-.whl/cudnn_fe} side=${TMPDIR:-/tmp}/pagedkv-cudnn-fe
  { [ -d "$cw" ] && [ "${CUDNN_FE:-1}" != 0 ]; } || { echo "cudnn frontend: not carried"; return 0; }
  rm -rf "$side"; python3 -m pip install -q --no-index --no-deps --target "$side" "$cw"/*.whl 2>/dev/null
  if PYTHONPATH=$PYTHONPATH:$side python3 -c "import cudnn; print('cudnn frontend', cudnn.__version__, 'backend', cudnn.backend_version())"; then
    export PYTHONPATH=$PYTHONPATH:$side
  else
    echo "carried cudnn frontend did not import"
  fi
}
