//! Model directory reading (in progress).
