# Copies the Python sources of python/mgpu (SRC) into a build tree's package (DST), leaving out
# any compiled _core found among the sources (a stray copy of another build's extension would
# otherwise overwrite the _core this build just linked there, and its tests would quietly run
# another engine). Run as: cmake -DSRC=... -DDST=... -P copy_package.cmake
file(COPY "${SRC}/" DESTINATION "${DST}"
     PATTERN "*.so" EXCLUDE
     PATTERN "__pycache__" EXCLUDE)
