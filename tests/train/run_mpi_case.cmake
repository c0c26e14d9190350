# Runs one MPI failure case and checks that it fails, clearly and in time:
#   cmake -DCOMMAND="mpirun;-np;2;..." -DLIMIT=60 [-DPATTERN=regex] -P run_mpi_case.cmake
# Passes when the command exits non-zero within LIMIT seconds and (if given) its output
# matches PATTERN. A command that outlives LIMIT is killed and the case fails (it hung).
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out
                TIMEOUT ${LIMIT})
string(TIMESTAMP t1 "%s")
math(EXPR took "${t1} - ${t0}")
message("${out}")
message("exit: ${rc} after ${took} s (limit ${LIMIT} s)")
if(NOT rc MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the run did not end by itself: ${rc}")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the run succeeded, but a rank had stopped answering")
endif()
if(DEFINED PATTERN AND NOT out MATCHES "${PATTERN}")
  message(FATAL_ERROR "the output does not match: ${PATTERN}")
endif()
