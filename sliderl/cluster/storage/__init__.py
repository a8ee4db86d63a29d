"""Where a run's files live: the storage root, a local folder or a URI (``root``), the Parquet trace log
(``trace_log``), model folders on every node (``model_files``) and prompt datasets (``data``)."""
